"""The torch backend (one process per node over torch.distributed, gloo on CPU) against the sim backend.

Same seed, same numbers: parameters, loss history, validation, bytes per node and simulated time agree with the
sim backend to float rounding (gloo may sum in another order than the sim's rank order). Strategies used here are
module-level classes, so they pickle into the node processes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.backends.errors import NodeProcessError
from exogym.runs.loggers import Logger
from exogym.strategy import OptimSpec, SimpleReduceStrategy, Strategy
from exogym.strategy import communicate

FIT = dict(progress=False, logger=False, val_interval=3)
HERE = Path(__file__).parent


class AverageEveryH(Strategy):
    """Plain SGD on each node; every H steps the models are averaged (sum of param.data, then divided)."""

    def __init__(self, H: int = 2, lr: float = 0.1):
        super().__init__()
        self.H, self.lr = H, lr

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=self.lr)

    @torch.no_grad()
    def step(self):
        self.optim.step()
        if (self.local_step + 1) % self.H == 0:
            for p in self.model.parameters():
                communicate.all_reduce(p.data, op=communicate.ReduceOp.SUM)
                p.data.div_(self.num_nodes)
        super().step()


class CollectivesTour(Strategy):
    """DDP through an async all-reduce, then every collective once per step, each leaving a trace in the
    parameters, so a wrong result on either backend changes the final model."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=self.lr)
        self.pair = communicate.new_group([0, 1])  # every node makes every group, in the same order
        self.tail = communicate.new_group(list(range(1, num_nodes)))

    @torch.no_grad()
    def step(self):
        params = list(self.model.parameters())
        grads = torch.cat([p.grad.reshape(-1) for p in params])
        communicate.all_reduce(grads, op="avg", async_op=True).wait()
        torch.nn.utils.vector_to_parameters(grads, [p.grad for p in params])
        self.optim.step()
        w = params[-1].data  # the last bias: [classes]
        if self.rank in self.pair:
            communicate.broadcast(w, src=1, group=self.pair)
        gathered = [torch.empty_like(w) for _ in range(self.num_nodes)]
        communicate.all_gather(gathered, w * (self.rank + 1))
        out = torch.empty_like(w)
        communicate.reduce_scatter(out, [g * (i + 1) for i, g in enumerate(gathered)], op="max")
        if self.rank in self.tail:
            communicate.all_reduce(out, op="avg", group=self.tail)
        communicate.barrier()
        w.add_(0.01 * out)
        super().step()


class FailOnRank1(SimpleReduceStrategy):
    def step(self):
        if self.rank == 1 and self.local_step == 1:  # its second step
            raise RuntimeError("injected failure on purpose")
        super().step()


class ListLogger(Logger):
    def __init__(self):
        self.rows = {"train": [], "val": []}

    def log(self, table, row):
        self.rows[table].append(row)


def _fit(strategy, num_nodes, backend, **kwargs):
    trainer = Trainer(toy.TinyMLP(dropout=0.1), toy.make_classification(192), toy.make_classification(32, seed=1))
    model = trainer.fit(strategy, num_nodes, batch_size=8, max_steps=6, seed=3, backend=backend,
                        **{**FIT, **kwargs})
    return toy.params(model), trainer.record


def _assert_same_run(sim, torch_run):
    (sim_params, sim_rec), (torch_params, torch_rec) = sim, torch_run
    assert_close(torch_params, sim_params, rtol=1e-5, atol=1e-6)
    assert_close(torch.tensor(torch_rec.node_loss), torch.tensor(sim_rec.node_loss), rtol=1e-5, atol=0)
    assert [r["step"] for r in torch_rec.val] == [r["step"] for r in sim_rec.val] == [0, 3, 6]
    assert_close(torch_rec.column("global_loss", "val"), sim_rec.column("global_loss", "val"), rtol=1e-5, atol=0)
    assert torch_rec.bytes_per_node == sim_rec.bytes_per_node
    for t, s in zip(torch_rec.comm_per_node, sim_rec.comm_per_node):
        assert (t["bytes_by_op"], t["calls_by_op"]) == (s["bytes_by_op"], s["calls_by_op"])
    # Simulated time: the torch backend exchanges arrival times and settles each clock by the sim's rule.
    assert len(torch_rec.sim_time_per_node) == len(sim_rec.sim_time_per_node)
    for t, s in zip(torch_rec.sim_time_per_node, sim_rec.sim_time_per_node):
        assert t == pytest.approx(s, rel=1e-9)


@pytest.mark.spawns
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_ddp_matches_the_sim_backend(num_nodes):
    strategy = SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1))
    sim_logger, torch_logger = ListLogger(), ListLogger()
    sim = _fit(strategy, num_nodes, "sim", network="medium", logger=sim_logger, log_interval=2)
    run = _fit(strategy, num_nodes, "torch", network="medium", logger=torch_logger, log_interval=2)
    _assert_same_run(sim, run)
    assert sim[1].bytes_per_node[0] > 0 and sim[1].sim_time_s > 0
    # The logger gets the same merged rows, forwarded from the node processes as they flush.
    assert [r["step"] for r in torch_logger.rows["train"]] == [2, 4, 6]  # log_interval=2
    assert_close(torch.tensor([r["loss"] for r in torch_logger.rows["train"]]),
                 torch.tensor([r["loss"] for r in sim_logger.rows["train"]]), rtol=1e-5, atol=0)
    assert [r["bytes"] for r in torch_logger.rows["train"]] == [r["bytes"] for r in sim_logger.rows["train"]]
    assert len(torch_logger.rows["val"]) == 3  # steps 0, 3, 6


@pytest.mark.spawns
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_averaging_every_h_steps_matches_the_sim_backend(num_nodes):
    strategy = AverageEveryH(H=2)
    sim, run = _fit(strategy, num_nodes, "sim"), _fit(strategy, num_nodes, "torch")
    _assert_same_run(sim, run)
    local = _fit(AverageEveryH(H=1000), num_nodes, "sim")  # the averaging made a difference
    assert not all(torch.allclose(a, b) for a, b in zip(local[0], sim[0]))


@pytest.mark.spawns
def test_the_spawn_start_method_gives_the_same_run(monkeypatch):
    """macOS and Windows start node processes with 'spawn' (Linux uses a forkserver): the same numbers."""
    import torch.multiprocessing as torch_mp
    from exogym.launch import launchers as torch_spawn

    monkeypatch.setattr(torch_spawn, "process_context", lambda: torch_mp.get_context("spawn"))
    strategy = AverageEveryH(H=2)
    _assert_same_run(_fit(strategy, 2, "sim"), _fit(strategy, 2, "torch"))


@pytest.mark.spawns
def test_every_collective_matches_the_sim_backend():
    slow_node = dict(network="home", node_speeds=[1, 1, 0.25])  # waiting, too, must match
    sim, run = _fit(CollectivesTour(), 3, "sim", **slow_node), _fit(CollectivesTour(), 3, "torch", **slow_node)
    _assert_same_run(sim, run)
    assert run[1].sim_time_per_node[0]["wait_s"] > 0
    assert set(run[1].comm_per_node[1]["calls_by_op"]) == {"all_reduce", "broadcast", "all_gather",
                                                            "reduce_scatter", "barrier"}


@pytest.mark.spawns
def test_checkpoint_and_resume_on_the_torch_backend_is_bit_identical(tmp_path):
    strategy = SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2), warmup_steps=2, cosine_anneal=True)
    full = _fit(strategy, 2, "torch")
    _fit(strategy, 2, "torch", checkpoint_interval=4, checkpoint_dir=tmp_path / "ckpt")
    resumed = _fit(strategy, 2, "torch", resume_from=tmp_path / "ckpt" / "step_000000004")
    assert all(torch.equal(a, b) for a, b in zip(resumed[0], full[0]))
    assert resumed[1].node_loss == full[1].node_loss
    assert resumed[1].bytes_per_node == full[1].bytes_per_node


@pytest.mark.spawns
def test_a_node_that_raises_ends_the_run_naming_its_rank():
    with pytest.raises(NodeProcessError, match=r"node 1 failed.*RuntimeError: injected failure on purpose") as info:
        _fit(FailOnRank1(OptimSpec(torch.optim.SGD, lr=0.1)), 2, "torch")
    assert info.value.rank == 1
    assert "Traceback" in str(info.value) and "in step" in str(info.value)  # the node's own traceback
    assert isinstance(info.value.__cause__, RuntimeError)


def test_an_unpicklable_strategy_is_rejected_before_any_process_starts():
    class LocalStrategy(SimpleReduceStrategy):  # defined in a function: a node process could not import it
        pass

    with pytest.raises(TypeError, match=r"pickling.*failed.*top level.*backend='sim'"):
        _fit(LocalStrategy(OptimSpec(torch.optim.SGD, lr=0.1)), 2, "torch")


def test_under_torchrun_num_nodes_must_equal_the_world_size(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"num_nodes=3 but torchrun started WORLD_SIZE=2 .* pass num_nodes=2"):
        _fit(SimpleReduceStrategy(), 3, "torch")


def test_under_torchrun_the_sim_backend_shares_the_nodes_and_checks_its_processes(monkeypatch):
    # Under torchrun backend="sim" runs over torchrun's processes (tests/backends/test_sim_processes.py runs it);
    # a processes= that disagrees, or more processes than nodes, is refused before anything starts.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"processes=3 but torchrun started WORLD_SIZE=2"):
        _fit(SimpleReduceStrategy(), 4, "sim", processes=3)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 processes for num_nodes=2"):
        _fit(SimpleReduceStrategy(), 2, "sim")


@pytest.mark.spawns
def test_torchrun_runs_one_node_per_process_and_matches_the_sim(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "torchrun_train.py"), str(tmp_path / "result")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"result.rank{r}.pt") for r in (0, 1))

    import torchrun_train  # the script's own setup, run here on the sim backend
    trainer = torchrun_train.make_trainer()
    model = trainer.fit(torchrun_train.make_strategy(), 2, backend="sim", **torchrun_train.FIT)
    assert_close(rank0["params"], toy.params(model), rtol=1e-5, atol=1e-6)
    assert_close(torch.tensor(rank0["node_loss"]), torch.tensor(trainer.record.node_loss), rtol=1e-5, atol=0)
    assert rank0["bytes_per_node"] == trainer.record.bytes_per_node
    # Every process returns the global model and a record of every node.
    assert all(torch.equal(a, b) for a, b in zip(rank1["params"], rank0["params"]))
    assert rank1["node_loss"] == rank0["node_loss"]
    # fit destroyed the process group it made: none is left for the interpreter's exit, where a gloo thread still
    # releasing its last collective aborted rank 1 once ("terminate called without an active exception")
    assert rank0["groups_alive"] == rank1["groups_alive"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nodes_sharing_a_gpu_go_through_gloo_and_match_the_sim():
    strategy = AverageEveryH(H=2)
    sim, run = _fit(strategy, 2, "sim", device="cuda"), _fit(strategy, 2, "torch", device="cuda")
    assert_close(run[0], sim[0], rtol=1e-4, atol=1e-5)
    assert run[1].bytes_per_node == sim[1].bytes_per_node


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nodes_on_gpus_of_their_own_use_nccl_and_match_the_sim():
    from exogym.backends.torch.node_process import pick_backend

    assert pick_backend([torch.device("cuda", 0), torch.device("cuda", 1)]) == "nccl"
    sim, run = _fit(CollectivesTour(), 2, "sim", devices=[0, 1]), _fit(CollectivesTour(), 2, "torch", devices=[0, 1])
    assert_close(run[0], sim[0], rtol=1e-4, atol=1e-5)
    assert run[1].bytes_per_node == sim[1].bytes_per_node
