"""One simulation over several processes (fit(processes=P)): every strategy gives what one process gives, to float
rounding where sums cross processes, with bytes and simulated time exactly equal; groups straddling processes in
a ring; misuse, a node's exception and a deadlock across processes are named; resume; torchrun."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import toy
from exogym import CollectiveError, NodeProcessError, RandomFailures, Trainer
from exogym.backends.hosting import block_of, blocks
from exogym.comm import all_reduce, barrier, broadcast, get_rank, get_world_size, new_group
from exogym.strategy import (DeMoStrategy, DGCStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec,
                             SimpleReduceStrategy, SPARTADiLoCoStrategy, SPARTAStrategy, Strategy)
from exogym.strategy.streaming_diloco import StreamingDiLoCoStrategy

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8, val_size=16, val_interval=4, network="low")
STRATEGIES = {
    "ddp": lambda: SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2), max_norm=0.5),
    "diloco": lambda: DiLoCoStrategy(lr=1e-2, H=3),
    "streaming-diloco": lambda: StreamingDiLoCoStrategy(lr=1e-2, H=4, num_fragments=2),
    "streaming-diloco-overlap": lambda: StreamingDiLoCoStrategy(lr=1e-2, H=4, num_fragments=2, tau=1),
    "sparta": lambda: SPARTAStrategy(lr=1e-2, p_sparta=0.2),
    "sparta-diloco": lambda: SPARTADiLoCoStrategy(lr=1e-2, p_sparta=0.2, H=3),
    "fedavg-islands-sampled": lambda: FedAvgStrategy(lr=0.1, H=2, island_size=2, client_sampling=0.67),
    "demo": lambda: DeMoStrategy(lr=1e-2, compression_topk=4, compression_chunk=4),
    "dgc": lambda: DGCStrategy(OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9)),
}


def _fit(make, processes, nodes=6, steps=8, model=None, **kw):
    trainer = Trainer(model or toy.TinyMLP(dropout=0.1), toy.make_classification(256))
    out = trainer.fit(make(), nodes, max_steps=steps, processes=processes, **{**FIT, **kw})
    return out, trainer.record


def _flat(model):
    return torch.cat([t.flatten().float() for t in model.state_dict().values()])


def _same_as_one_process(one, many, exact=False, counts=(1, 2)):
    (m1, r1), (m2, r2) = one, many
    if exact:
        assert torch.equal(_flat(m1), _flat(m2))
    else:  # only sums across processes reassociate
        torch.testing.assert_close(_flat(m2), _flat(m1), rtol=1e-6, atol=1e-6)
    assert r2.bytes_per_node == r1.bytes_per_node and r2.payload_bytes_per_node == r1.payload_bytes_per_node
    assert r2.sim_time_per_node == r1.sim_time_per_node  # the simulated K-node cluster, not the P processes
    assert len(r2.train) == len(r1.train) and [row["step"] for row in r2.val] == [row["step"] for row in r1.val]
    torch.testing.assert_close(torch.tensor(r2.column("loss")), torch.tensor(r1.column("loss")), rtol=1e-5, atol=1e-6)
    assert r1.config["processes"] == counts[0] and r2.config["processes"] >= counts[1]


def test_blocks_are_contiguous_and_differ_by_at_most_one():
    assert [list(b) for b in blocks(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(b) for b in blocks(8, 3)] == [3, 3, 2] and block_of(8, 3) == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [list(b) for b in blocks(3, 3)] == [[0], [1], [2]]


@pytest.mark.spawns
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_over_processes_gives_what_one_process_gives(name):
    nodes, processes = (6, 3) if name in ("fedavg-islands-sampled", "sparta") else (5, 2)
    one = _fit(STRATEGIES[name], 1, nodes=nodes)
    _same_as_one_process(one, _fit(STRATEGIES[name], processes, nodes=nodes))


@pytest.mark.spawns
def test_failures_and_an_elastic_pool_over_processes():
    make = STRATEGIES["diloco"]
    for kw in (dict(failures=RandomFailures(0.2, downtime=2, seed=3)), dict(active_nodes=[(1, 8), (4, 5), (7, 8)])):
        _same_as_one_process(_fit(make, 1, nodes=8, **kw), _fit(make, 3, nodes=8, **kw))


@pytest.mark.spawns
def test_the_same_processes_and_seed_give_the_same_bits():
    a, b = (_fit(STRATEGIES["ddp"], 2, nodes=5) for _ in range(2))
    assert torch.equal(_flat(a[0]), _flat(b[0])) and a[1].node_loss == b[1].node_loss


_WAITING: dict = {}  # in each simulating process: (step, rank) -> the flat buffer that node all-reduces


class FoldsAcrossProcesses(Strategy):
    """Every node all-reduces a flat buffer of its own (AVG and SUM) over the world, which crosses processes. A
    node notes, before its own call, how many lower-ranked nodes of its process wait in that all-reduce and how
    many of those still hold their buffer's memory; what each node noted and received goes to `folder`."""

    def __init__(self, folder: str):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1))
        self.folder = folder

    def step(self):
        from exogym.comm import ReduceOp

        r = get_rank()
        for i, op in enumerate((ReduceOp.AVG, ReduceOp.SUM)):
            key = (self.local_step, i)
            waiting = [t for (k, q), t in _WAITING.items() if k == key and q < r]
            held = sum(t.untyped_storage().nbytes() > 0 for t in waiting)
            t = torch.arange(1000, dtype=torch.float32) * (r + 1) / 7 + self.local_step
            _WAITING[key, r] = t
            all_reduce(t, op=op)
            torch.save({"waiting": len(waiting), "held": held, "result": t},
                       os.path.join(self.folder, f"{r}-{self.local_step}-{i}.pt"))
        self.optim.step()
        super().step()


@pytest.mark.spawns
def test_nodes_waiting_on_another_process_hand_back_their_reduction_buffers(tmp_path):
    # Within a process the nodes' buffers are folded, in rank order, into one accumulator as they arrive (the
    # process's part of the sum, sent once the last has come) and give back their memory until the reply comes:
    # a process waiting on the other holds one accumulator, not one buffer per node. The result is the same
    # rank-order sum of parts, bit for bit.
    nodes, processes, steps = 5, 2, 2
    _fit(lambda: FoldsAcrossProcesses(str(tmp_path)), processes, nodes=nodes, steps=steps, val_interval=10**6)
    owner = block_of(nodes, processes)
    for step in range(steps):
        parts = [torch.arange(1000, dtype=torch.float32) * (q + 1) / 7 + step for q in range(nodes)]
        blocks_ = [[parts[q] for q in range(nodes) if owner[q] == p] for p in range(processes)]
        folded = []
        for block in blocks_:
            acc = block[0].clone()
            for t in block[1:]:
                acc.add_(t)
            folded.append(acc)
        total = folded[0].clone()
        for acc in folded[1:]:
            total.add_(acc)
        for i, want in enumerate((total / nodes, total)):
            for r in range(nodes):
                seen = torch.load(tmp_path / f"{r}-{step}-{i}.pt")
                assert seen["waiting"] == r - owner.index(owner[r])  # its process's lower-ranked nodes
                assert seen["held"] == 0, f"node {r}, step {step}: {seen['held']} waiting node(s) kept their buffer"
                assert torch.equal(seen["result"], want)


class RingPairs(Strategy):
    """Every node averages its gradient with its left and right neighbours' (pairs in a ring), even ranks right
    pair first, odd ranks left first, as a blocking cluster needs; blocks of 2 in 3 processes put every second pair
    across two processes, in a ring (0-1 | 2-3 | 4-5, then 1-2, 3-4, 5-0). Then one async broadcast from the
    last node, and a barrier."""

    def __init__(self):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1))

    def step(self):
        k, r = get_world_size(), get_rank()
        pairs = {q: new_group(sorted({q, (q + 1) % k})) for q in range(k)}  # every node creates every group
        right, left = pairs[r], pairs[(r - 1) % k]
        for group in ((right, left) if r % 2 == 0 else (left, right)):
            for p in self.model.parameters():
                all_reduce(p.grad, group=group)
                p.grad.div_(2)
        head = next(self.model.parameters())
        work = broadcast(head.data, src=k - 1, async_op=True)
        work.wait()
        barrier()
        self.optim.step()
        super().step()


@pytest.mark.spawns
def test_groups_straddling_processes_in_a_ring_complete_exactly():
    one = _fit(RingPairs, 1, nodes=6, steps=4)
    many = _fit(RingPairs, 3, nodes=6, steps=4)
    _same_as_one_process(one, many)
    assert many[1].node_loss == one[1].node_loss  # sums of two and broadcasts: training is exact (the final
    # average of six nodes over three processes is the only reassociated sum)


class EveryCollective(Strategy):
    """Each collective of the comm layer, every reduce op, async, on the world and on a group straddling
    processes, with rank-dependent values; what each node received goes into the model so it is compared."""

    def __init__(self):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1))

    def step(self):
        from exogym.comm import ReduceOp, all_gather, reduce_scatter

        k, r = get_world_size(), get_rank()
        x = torch.arange(4, dtype=torch.float32) + r * 1.5 + self.local_step
        got = []
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT):
            t = x.clone() / 4
            all_reduce(t, op=op)
            got.append(t)
        middle = new_group([k // 2 - 1, k // 2])  # straddles the first two processes
        if r in (k // 2 - 1, k // 2):
            t = x.clone()
            all_reduce(t, group=middle, async_op=True).wait()
            got.append(t)
        outs = [torch.empty(4) for _ in range(k)]
        all_gather(outs, x)
        got += outs
        out = torch.empty(4)
        reduce_scatter(out, [x * (i + 1) for i in range(k)])
        got.append(out)
        src = torch.full((4,), float(r))
        broadcast(src, src=k - 1)
        got.append(src)
        barrier(async_op=True).wait()
        with torch.no_grad():
            head = next(self.model.parameters())
            head.view(-1)[:4].add_(torch.stack(got).sum(0) * 1e-3)
        self.optim.step()
        super().step()


@pytest.mark.spawns
def test_every_collective_and_reduce_op_across_processes():
    one = _fit(EveryCollective, 1, nodes=5, steps=3)
    for processes in (2, 3):
        _same_as_one_process(one, _fit(EveryCollective, processes, nodes=5, steps=3))


class ShapeMismatch(Strategy):
    def __init__(self):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1))

    def step(self):
        all_reduce(torch.zeros(2 if get_rank() < 3 else 3))
        self.optim.step()
        super().step()


class LastNodeWaitsAlone(Strategy):
    """At its second step the last node (process 1) waits on a group with node 0 (process 0), which never comes."""

    def __init__(self):
        super().__init__(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1))

    def step(self):
        if get_rank() == get_world_size() - 1 and self.local_step == 1:
            all_reduce(torch.zeros(2), group=new_group([0, get_rank()]))
        self.optim.step()
        super().step()


@pytest.mark.spawns
def test_a_mismatch_across_processes_is_a_collective_error_naming_the_nodes():
    started = time.monotonic()
    with pytest.raises(CollectiveError, match=r"mismatched collective .* node 0 .* node 3"):
        _fit(ShapeMismatch, 2, nodes=6, steps=2)
    assert time.monotonic() - started < 30


@pytest.mark.spawns
def test_a_collective_a_node_never_makes_is_named_within_seconds():
    started = time.monotonic()
    with pytest.raises(CollectiveError, match=r"deadlock across processes(.|\n)*node 5 \(step 2\)"):
        _fit(LastNodeWaitsAlone, 2, nodes=6, steps=3)
    assert time.monotonic() - started < 30


class FailsOnNode4(SimpleReduceStrategy):
    def step(self):
        if self.rank == 4 and self.local_step == 1:
            raise ValueError("boom on node 4")
        super().step()


@pytest.mark.spawns
def test_an_exception_in_a_node_stops_every_process_and_names_the_node():
    with pytest.raises(NodeProcessError, match="boom on node 4") as info:
        _fit(lambda: FailsOnNode4(OptimSpec(torch.optim.SGD, lr=0.1)), 2, nodes=6, steps=3)
    assert info.value.rank == 4


def test_bad_processes_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"processes=7 is more than num_nodes=6"):
        _fit(STRATEGIES["ddp"], 7)
    with pytest.raises(ValueError, match=r"backend='torch' already runs one process per node"):
        _fit(STRATEGIES["ddp"], 2, backend="torch")
    with pytest.raises(ValueError, match="processes must be"):
        _fit(STRATEGIES["ddp"], 0)


@pytest.mark.spawns
def test_resume_with_the_same_processes_is_bit_identical(tmp_path):
    make = STRATEGIES["diloco"]
    whole = _fit(make, 2, nodes=5, steps=6, checkpoint_interval=3, checkpoint_dir=tmp_path / "ck")
    resumed = _fit(make, 2, nodes=5, steps=6, resume_from=tmp_path / "ck" / "step_000000003")
    assert torch.equal(_flat(whole[0]), _flat(resumed[0]))
    assert whole[1].node_loss == resumed[1].node_loss and whole[1].bytes_per_node == resumed[1].bytes_per_node


@pytest.mark.spawns
def test_resume_with_other_processes_continues_the_run(tmp_path):
    make = STRATEGIES["diloco"]
    whole = _fit(make, 2, nodes=5, steps=6, checkpoint_interval=3, checkpoint_dir=tmp_path / "ck")
    resumed = _fit(make, 3, nodes=5, steps=6, resume_from=tmp_path / "ck" / "step_000000003")
    _same_as_one_process(whole, resumed, counts=(2, 3))  # the same run; only sums across processes reassociate


class StuckOnNode3(SimpleReduceStrategy):
    def step(self):
        if self.rank == 3 and self.local_step == 1:
            started = time.monotonic()
            while time.monotonic() - started < 60:  # stuck in Python (native code is named once it returns)
                pass
        super().step()


@pytest.mark.spawns
def test_a_stuck_node_in_any_process_is_named_by_its_watchdog():
    from exogym import NodeTimeoutError

    started = time.monotonic()
    with pytest.raises(NodeTimeoutError, match=r"node 3 ran for") as info:
        _fit(lambda: StuckOnNode3(OptimSpec(torch.optim.SGD, lr=0.1)), 2, nodes=4, steps=3, node_timeout=2)
    assert info.value.rank == 3 and time.monotonic() - started < 30


TORCHRUN_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
import toy
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy

if __name__ == "__main__":
    t = Trainer(toy.TinyMLP(dropout=0.1), toy.make_classification(256))
    model = t.fit(DiLoCoStrategy(lr=1e-2, H=3), 5, max_steps=6, progress=False, device="cpu", logger=False,
                  batch_size=8, val_size=16, val_interval=4, network="low")
    torch.save({{"flat": torch.cat([v.flatten().float() for v in model.state_dict().values()]),
                "bytes": t.record.bytes_per_node, "processes": t.record.config["processes"]}},
               {out!r} + "." + os.environ["RANK"])
"""


@pytest.mark.spawns
def test_torchrun_with_the_sim_backend_splits_the_nodes_over_its_processes(tmp_path):
    script = tmp_path / "train.py"
    out = tmp_path / "result"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(Path(__file__).resolve().parent.parent), out=str(out)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [torch.load(p) for p in sorted(tmp_path.glob("result.*"))]
    one = _fit(lambda: DiLoCoStrategy(lr=1e-2, H=3), 1, nodes=5, steps=6)
    assert [r["processes"] for r in results] == [2, 2]
    for r in results:  # every process returns the global model and the whole record
        torch.testing.assert_close(r["flat"], _flat(one[0]), rtol=1e-6, atol=1e-6)
        assert r["bytes"] == one[1].bytes_per_node
