"""How a run that stops part-way ends: every completed step's row kept (train.csv and trainer.record, also on the
exception), a non-finite loss traced to the node and step where it first appeared, and the run folder saying
"failed" (with the error) or "interrupted" (SIGINT/SIGTERM, with the checkpoint to resume from)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from exogym import NonFiniteLoss, Trainer
from exogym.backends.sim.watchdog import STUCK_EXIT_CODE, stuck_grace
from exogym.strategy import DiLoCoStrategy, SimpleReduceStrategy
from exogym.strategy.optim import OptimSpec

from faulty import FailAt, FailOnNode, NanOnNode, NanWhenEvaluatedLater, SqrtLoss, ZeroOnNode
from toy import TinyMLP, make_classification

TESTS = Path(__file__).parent


def sgd(lr: float = 0.05) -> OptimSpec:
    return OptimSpec(torch.optim.SGD, lr=lr)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def folder_of(error: BaseException) -> Path:
    assert error.run_folder is not None
    return Path(error.run_folder)


@pytest.mark.parametrize("strategy", [lambda: SimpleReduceStrategy(sgd()), lambda: DiLoCoStrategy(sgd(), H=5)],
                         ids=["ddp", "diloco"])
def test_a_nan_names_the_node_and_step_where_it_first_appeared_and_keeps_every_row(strategy):
    # Node 2's step-2 batch holds nan. Before: DDP named node 0 at step 2 and DiLoCo node 0 at step 6 (after the
    # average spread it), and the run had no train.csv and no record (rows go out every 10 steps).
    data = NanOnNode(rank=2)
    trainer = Trainer(TinyMLP(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(strategy(), 4, max_steps=30, batch_size=16, shuffle=False, progress=False, val_interval=100)
    error = info.value
    assert (error.rank, error.step, error.table) == (2, 2, "train") and math.isnan(error.value)
    assert "on node 2 is nan at step 2, the run's first" in str(error)
    record = trainer.record
    assert record is error.record and len(record.train) >= 9  # every step all four nodes completed before the check
    assert math.isnan(record.node_loss[2][1]) and all(math.isfinite(record.node_loss[r][0]) for r in range(4))
    table = rows(folder_of(error) / "train.csv")
    assert [int(r["step"]) for r in table] == list(range(1, len(record.train) + 1))
    summary = json.loads((folder_of(error) / "summary.json").read_text())
    assert summary["status"] == "failed" and "node 2 is nan at step 2" in summary["error"]
    assert summary["steps"] == len(record.train)
    assert json.loads((folder_of(error) / ".exogym-run").read_text())["status"] == "failed"


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled", "ignore:Error detected in")
def test_a_nan_gradient_behind_a_finite_loss_is_traced_to_the_update_that_spread_it():
    # Node 1's step-2 batch gives sqrt(0): a finite loss whose gradient is nan. DDP averages it into every node,
    # whose losses are all nan at step 3: the message says so, rather than naming node 0.
    trainer = Trainer(SqrtLoss(), ZeroOnNode(rank=1))
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 3, max_steps=20, batch_size=16, shuffle=False, progress=False,
                    logger=False)
    assert info.value.step == 3 and "on every node is nan at step 3" in str(info.value)
    assert "either step 2's update made the parameters they share non-finite" in str(info.value)
    assert "or step 3's forward pass is non-finite on every node" in str(info.value)
    assert math.isfinite(trainer.record.node_loss[1][1]) and math.isnan(trainer.record.node_loss[0][2])
    assert "torch.autograd.detect_anomaly()" in str(info.value)
    # The hint holds: under anomaly detection the backward that makes the nan raises, in node 1 at step 2.
    with torch.autograd.detect_anomaly(), pytest.raises(RuntimeError, match="returned nan values") as anomaly:
        Trainer(SqrtLoss(), ZeroOnNode(rank=1)).fit(SimpleReduceStrategy(sgd()), 3, max_steps=20, batch_size=16,
                                                    shuffle=False, progress=False, logger=False)
    assert "(raised in node 1 at step 2)" in anomaly.value.__notes__


class _NanForEveryNode:
    """Every node's own 64 examples, with examples 96-111 (step 7's, at batch 16 unshuffled over 128) nan on all."""

    def __call__(self, rank: int, num_nodes: int, is_val: bool) -> TensorDataset:
        x, y = make_classification(128, seed=rank).tensors
        if not is_val:
            x = x.clone()
            x[96:112] = float("nan")
        return TensorDataset(x, y)


def test_a_nan_made_by_every_nodes_forward_pass_is_not_blamed_on_an_update():
    # Step 7's batches are nan on every node: the losses are finite through step 6 and nan at 7 everywhere, with
    # every parameter finite until step 7's own backward. Before, the message said the parameters "became
    # non-finite in step 6's update".
    data = _NanForEveryNode()
    trainer = Trainer(TinyMLP(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(DiLoCoStrategy(sgd(), H=5), 2, max_steps=12, batch_size=16, shuffle=False, progress=False,
                    logger=False, val_interval=100)
    message = str(info.value)
    assert info.value.step == 7 and "on every node is nan at step 7" in message
    assert "step 7's forward pass is non-finite on every node" in message and "became non-finite" not in message
    assert all(math.isfinite(trainer.record.node_loss[r][5]) for r in range(2))


@pytest.mark.spawns
def test_a_nan_in_one_process_of_several_is_named_too():
    data = NanOnNode(rank=2)
    trainer = Trainer(TinyMLP(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(DiLoCoStrategy(sgd(), H=5), 4, max_steps=30, batch_size=16, shuffle=False, progress=False,
                    processes=2, val_interval=100)
    assert (info.value.rank, info.value.step) == (2, 2)
    assert len(trainer.record.train) >= 9


@pytest.mark.spawns
def test_a_nan_on_the_torch_backend_is_named_from_every_node_process():
    data = NanOnNode(rank=1)
    trainer = Trainer(TinyMLP(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(DiLoCoStrategy(sgd(), H=5), 2, max_steps=30, batch_size=16, shuffle=False, progress=False,
                    backend="torch", val_interval=100, logger=False)
    assert (info.value.rank, info.value.step) == (1, 2)
    assert len(trainer.record.train) >= 9


def test_a_nan_validation_loss_is_an_error():
    # Before: status "completed" with a validation loss of nan, and no warning. Here the validation data holds nan,
    # so the initial model's evaluation (step 0) already fails: nothing was trained, so no run folder is kept.
    data = NanOnNode(rank=0, first=0, last=64, val=True)
    trainer = Trainer(TinyMLP(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 2, max_steps=12, batch_size=16, shuffle=False, progress=False)
    assert (info.value.table, info.value.step) == ("val", 0) and "validation loss" in str(info.value)
    assert trainer.record.val and math.isnan(trainer.record.val[0]["global_loss"])
    assert info.value.run_folder is None and not Path("logs").exists()


def test_a_validation_loss_that_turns_nan_after_training_began_fails_the_run_folder():
    data = NanOnNode(rank=99)  # no nan in the data: the model's evaluation turns nan from step 3
    trainer = Trainer(NanWhenEvaluatedLater(), data, data)
    with pytest.raises(NonFiniteLoss) as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 2, max_steps=12, batch_size=16, shuffle=False, progress=False,
                    val_interval=4)
    assert info.value.table == "val" and info.value.step == 4
    summary = json.loads((folder_of(info.value) / "summary.json").read_text())
    assert summary["status"] == "failed" and "validation loss" in summary["error"]
    assert summary["steps"] == len(trainer.record.train) >= 3  # node 1 may not have recorded step 4 yet


def test_a_run_that_raises_part_way_keeps_every_completed_row():
    # Step 7's batch cannot be read: steps 1-6 are in train.csv and the record (log_interval=1, but the nodes hand
    # their rows over only every 10 steps).
    trainer = Trainer(TinyMLP(), FailAt(16 * 6))
    with pytest.raises(RuntimeError, match="example 96 cannot be read") as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 1, max_steps=30, batch_size=16, shuffle=False, progress=False)
    assert len(trainer.record.train) == 6 and info.value.record is trainer.record
    assert [int(r["step"]) for r in rows(folder_of(info.value) / "train.csv")] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((folder_of(info.value) / "summary.json").read_text())
    assert summary["status"] == "failed" and "example 96" in summary["error"] and summary["steps"] == 6


@pytest.mark.spawns
@pytest.mark.parametrize("backend, processes", [("sim", 2), ("torch", 1)])
def test_a_failure_in_one_process_keeps_the_rows_the_other_processes_completed(backend, processes):
    # Node 3 cannot read its step-7 batch. DiLoCo's nodes meet every 5 steps, so the nodes in other processes are
    # ahead (waiting at step 10's average) with rows not yet handed over: stopped, they send them before exiting.
    trainer = Trainer(TinyMLP(), FailOnNode(rank=3, index=16 * 6))
    with pytest.raises(Exception, match="example 96 cannot be read") as info:
        trainer.fit(DiLoCoStrategy(sgd(), H=5), 4, max_steps=30, batch_size=16, shuffle=False, progress=False,
                    backend=backend, processes=processes)
    # Every node completed step 6, unless the average of step 5 had not yet reached another process (a window of
    # the time node 3 takes for step 6): its nodes had then completed step 4. Without the rows the stopped
    # processes send, the record would hold no step at all (rows go out every 10 steps).
    steps = len(trainer.record.train)
    assert steps in (4, 6)
    completed = [len(losses) for losses in trainer.record.node_loss]  # each node's own: the others went on
    assert completed[3] == 6 and min(completed) == steps and max(completed) <= 9
    assert [int(r["step"]) for r in rows(folder_of(info.value) / "train.csv")] == list(range(1, steps + 1))


_INTERRUPTED = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
from torch.utils.data import TensorDataset
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy
from exogym.strategy.optim import OptimSpec
from faulty import FailOnNode
from toy import TinyMLP
if __name__ == "__main__":
    # Node {nodes} - 1 reads its step-7 batch and sends {signal} to this process (the one that called fit).
    trainer = Trainer(TinyMLP(), FailOnNode({nodes} - 1, 16 * 6, {signal!r}, pid=os.getpid()))
    try:
        trainer.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.05), H=2), {nodes}, max_steps=30, batch_size=16,
                    shuffle=False, progress=False, run_name="r", checkpoint_interval=4, processes={processes})
    except KeyboardInterrupt as e:
        print(json.dumps({{"type": type(e).__name__, "notes": getattr(e, "__notes__", []),
                          "steps": len(trainer.record.train)}}))
"""


@pytest.mark.spawns
@pytest.mark.parametrize("sig, nodes, processes", [("SIGTERM", 1, 1), ("SIGINT", 1, 1), ("SIGTERM", 4, 2)])
def test_a_signal_interrupts_the_run_which_says_so_and_names_its_newest_checkpoint(sig, nodes, processes,
                                                                                    tmp_path):
    # Before: SIGTERM left the folder saying "running" with no summary.json; Ctrl-C was recorded as "failed".
    script = tmp_path / "run.py"
    script.write_text(_INTERRUPTED.format(tests=str(TESTS), signal=sig, nodes=nodes, processes=processes))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said["type"] == ("RunInterrupted" if sig == "SIGTERM" else "KeyboardInterrupt")
    # Node 3 waits in its step 7 until it is stopped. With two processes, the other process may not have received
    # step 6's average yet when the stop reaches it: its nodes have then completed step 5.
    steps = said["steps"]
    assert steps == 6 if processes == 1 else steps in (5, 6)
    run = tmp_path / "logs" / "r"
    newest = Path("logs/r/checkpoints/step_000000004")
    assert f"resume_from={str(newest)!r}" in said["notes"][-1] and (tmp_path / newest).is_dir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == sig and summary["steps"] == steps
    assert Path(summary["resume_from"]) == newest
    assert json.loads((run / ".exogym-run").read_text())["status"] == "interrupted"
    assert [int(r["step"]) for r in rows(run / "train.csv")] == list(range(1, steps + 1))


_STUCK = """
import sys
sys.path.insert(0, {tests!r})
from exogym import Trainer
from exogym.strategy import SimpleReduceStrategy
from faulty import StuckInNativeCode
from toy import TinyMLP, make_classification
from exogym.backends.sim import watchdog

watchdog.stuck_grace = lambda timeout: 1.0  # the node never stops: a shorter grace only ends the wait sooner

class Stuck(StuckInNativeCode, SimpleReduceStrategy):
    pass

if __name__ == "__main__":
    Trainer(TinyMLP(), make_classification(256)).fit(Stuck("sgd", lr=0.05), 2, max_steps=30, batch_size=8,
                                                     shuffle=False, progress=False, run_name="r", node_timeout=2.0)
"""


@pytest.mark.spawns
def test_a_node_stuck_in_native_code_ends_the_process_with_the_run_folder_saying_so(tmp_path):
    # No signal reaches it, so the watchdog names it on stderr (its stack down to the Python line that called into
    # native code), records the failure through fit's on_stuck (and the rows of steps 1-6), and ends the process
    # with exit code 124 (STUCK_EXIT_CODE) once the grace after node_timeout is over.
    script = tmp_path / "run.py"
    script.write_text(_STUCK.format(tests=str(TESTS)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert stuck_grace(2.0) == 5.0
    assert proc.returncode == STUCK_EXIT_CODE, err
    assert "exogym watchdog: node 1 ran for" in err and "in step 7 without finishing it" in err, err
    assert "torch.futures.Future().wait()" in err  # its stack: the Python line that called into native code
    assert "inside native code that ignores signals" in err
    assert f"Its process ({proc.pid}) exits now with code {STUCK_EXIT_CODE}" in err
    run = tmp_path / "logs" / "r"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("NodeTimeoutError: node 1 ran for")
    assert summary["steps"] == 6 and [int(r["step"]) for r in rows(run / "train.csv")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((run / ".exogym-run").read_text())["status"] == "failed"


def test_with_a_log_interval_the_newest_completed_row_still_reaches_train_csv():
    # Rows go to the loggers every log_interval steps (and the last); a run stopping at step 7 wrote step 5's, and
    # now step 6's too: the folder shows how far it got.
    trainer = Trainer(TinyMLP(), FailAt(16 * 6))
    with pytest.raises(RuntimeError, match="example 96") as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 1, max_steps=30, batch_size=16, shuffle=False, progress=False,
                    log_interval=5)
    assert [int(r["step"]) for r in rows(folder_of(info.value) / "train.csv")] == [5, 6]
    assert len(trainer.record.train) == 6


def test_a_resumed_run_that_fails_keeps_the_steps_from_before_its_checkpoint_too():
    # The first attempt fails reading step 12's batch, after its checkpoint at step 8; the resumed run fails reading
    # step 11's: its record and train.csv hold steps 1-10, not only the steps trained since the checkpoint.
    def fit(data, **resume):
        trainer = Trainer(TinyMLP(), data)
        with pytest.raises(RuntimeError, match="cannot be read") as info:
            trainer.fit(SimpleReduceStrategy(sgd()), 1, max_steps=12, batch_size=16, shuffle=False, progress=False,
                        run_name="r", checkpoint_interval=8, **resume)
        return trainer, info.value

    fit(FailAt(16 * 11))
    trainer, error = fit(FailAt(16 * 10), resume_from="logs/r")
    assert [row["step"] for row in trainer.record.train] == list(range(1, 11))
    assert [int(r["step"]) for r in rows(folder_of(error) / "train.csv")] == list(range(1, 11))


def test_a_node_that_fails_before_the_others_ran_keeps_its_own_rows_in_node_loss():
    # DiLoCo's nodes meet every 10 steps and the sim starts a node on its first turn: node 0 fails reading its step-4
    # batch before nodes 1-3 ran a step. No step was completed by every node (record.train is empty, and the run
    # folder is given back), but node_loss keeps node 0's three steps.
    trainer = Trainer(TinyMLP(), FailOnNode(rank=0, index=16 * 3))
    with pytest.raises(RuntimeError, match="example 48") as info:
        trainer.fit(DiLoCoStrategy(sgd(), H=10), 4, max_steps=30, batch_size=16, shuffle=False, progress=False)
    assert trainer.record.train == [] and [len(losses) for losses in trainer.record.node_loss] == [3, 0, 0, 0]
    assert info.value.run_folder is None


class _StoppedBySigterm(torch.utils.data.Dataset):
    """Reading example 96 (step 7's first) raises what a SIGTERM handler of the caller's own raises (a sweep
    worker's, a simulating process's): KeyboardInterrupt("SIGTERM")."""

    def __init__(self):
        self.data = make_classification(256)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == 96:
            raise KeyboardInterrupt("SIGTERM")
        return self.data[i]


def test_an_interrupt_raised_by_the_callers_own_sigterm_handler_is_recorded_as_sigterm():
    trainer = Trainer(TinyMLP(), _StoppedBySigterm())
    with pytest.raises(KeyboardInterrupt) as info:
        trainer.fit(SimpleReduceStrategy(sgd()), 1, max_steps=30, batch_size=16, shuffle=False, progress=False)
    summary = json.loads((folder_of(info.value) / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["steps"] == 6
