"""Fault injection: a checkpointed run is stopped at random steps (an exception, SIGINT, SIGTERM, SIGKILL) or by a
disk of a random size filling up, and nothing it completed may be lost: train.csv holds whole rows of consecutive steps, every complete checkpoint
loads, the run folder says how it ended (except after SIGKILL, which nothing can record), and resuming from the
newest checkpoint gives the uninterrupted run's rows exactly. The steps are drawn from a seeded generator, printed
on failure, so a failing draw can be replayed."""

from __future__ import annotations

import csv
import os
import json
import random
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

import fault_run
from small_disk import small_disk_unavailable
from exogym import RunFolderError
from exogym.runs.checkpoint import find_checkpoint, load_checkpoint, read_manifest

SCRIPT = Path(fault_run.__file__)
KINDS = ("raise", "SIGINT", "SIGTERM", "SIGKILL")
DRAWS = [(kind, random.Random(kind).randint(2, fault_run.MAX_STEPS // 2)) for kind in KINDS]
COMPARED = ("step", "loss", "accuracy", "lr", "bytes")  # a row's measured values (not its wall time)


def table(run: Path) -> list[dict[str, str]]:
    if not (run / "train.csv").exists():
        return []  # killed before its first rows were written
    with open(run / "train.csv", newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    assert all(len(r) == len(header) for r in rows), "a row of train.csv was cut off"
    return [dict(zip(header, r)) for r in rows[1:]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict[str, str]]:
    where, back = tmp_path_factory.mktemp("uninterrupted"), os.getcwd()
    os.chdir(where)  # the run writes logs/r in the working folder; in this process (one process, one thread)
    try:
        fault_run.fit()
    finally:
        os.chdir(back)
    return table(where / "logs" / "r")


@pytest.mark.spawns
@pytest.mark.parametrize("kind, step", DRAWS, ids=[f"{k}-at-step-{s}" for k, s in DRAWS])
def test_a_run_stopped_at_a_random_step_loses_nothing_it_completed(kind, step, tmp_path, uninterrupted):
    out = subprocess.run([sys.executable, str(SCRIPT), kind, str(step)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0, f"the {kind} at step {step} did not stop the run"
    run = tmp_path / "logs" / "r"
    rows = table(run)
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, len(steps) + 1))
    if kind != "SIGKILL":  # every step both nodes completed: node 1 stopped in step `step`
        assert len(steps) == step - 1, out.stderr[-2000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == ("failed" if kind == "raise" else "interrupted") and summary["steps"] == step - 1
    else:  # rows go out every 10 steps and at each checkpoint: those written before the kill are all there
        assert len(steps) >= (step - 1) // fault_run.CHECKPOINT_INTERVAL * fault_run.CHECKPOINT_INTERVAL
        with pytest.raises(RunFolderError, match="its process ended without recording how"):
            fault_run.fit()  # the name is still the killed run's (here: the working folder is tmp_path)
    for folder in sorted((run / "checkpoints").glob("step_*")):
        if (folder / "manifest.json").exists():
            load_checkpoint(folder, read_manifest(folder), devices=[torch.device("cpu")] * 2)
    for r, expected in zip(rows, uninterrupted):
        assert [r[k] for k in COMPARED] == [expected[k] for k in COMPARED]
    if step - 1 < fault_run.CHECKPOINT_INTERVAL:
        return  # stopped before its first checkpoint: nothing to resume from
    newest = find_checkpoint(run)
    assert int(newest.name.removeprefix("step_")) == (step - 1) // fault_run.CHECKPOINT_INTERVAL * \
        fault_run.CHECKPOINT_INTERVAL
    fault_run.resume(str(run))  # in this process: the stopped one is gone
    assert [[r[k] for k in COMPARED] for r in table(run)] == [[r[k] for k in COMPARED] for r in uninterrupted]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    shutil.rmtree(run)


DISK_KB = random.Random("disk").randint(100, 260)  # a whole run needs about 300 KB at its peak: it fills mid-run


@pytest.mark.spawns
def test_a_run_whose_disk_fills_up_at_a_random_point_loses_nothing_it_completed(tmp_path, uninterrupted, monkeypatch):
    why = small_disk_unavailable()
    if why is not None:
        pytest.skip(why)
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir(), out.mkdir()
    # The run's folder is a DISK_KB tmpfs of its own (in a private mount namespace, gone with the command): what the
    # run left there is copied out for the checks.
    command = (f"mount -t tmpfs -o size={DISK_KB}k tmpfs '{disk}' && cd '{disk}' && "
               f"'{sys.executable}' '{SCRIPT}' none 0; echo $? > '{out}/rc'; cp -a logs '{out}/'")
    ran = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, timeout=180)
    assert (out / "rc").read_text().strip() == "1", f"a {DISK_KB} KB disk did not stop the run:\n{ran.stderr[-3000:]}"
    assert "DiskFullError" in ran.stderr and "disk" in ran.stderr.lower(), ran.stderr[-3000:]
    run = out / "logs" / "r"
    rows = table(run)
    assert [int(r["step"]) for r in rows] == list(range(1, len(rows) + 1))
    for r, expected in zip(rows, uninterrupted):
        assert [r[k] for k in COMPARED] == [expected[k] for k in COMPARED]
    marker = json.loads((run / ".exogym-run").read_text())
    assert marker["status"] == "failed", marker
    newest = find_checkpoint(run)
    load_checkpoint(newest, read_manifest(newest), devices=[torch.device("cpu")] * 2)
    monkeypatch.chdir(out)
    fault_run.resume()  # in this process, from the copy (logs/r)
    assert [[r[k] for k in COMPARED] for r in table(run)] == [[r[k] for k in COMPARED] for r in uninterrupted]


# ---- across processes: fit(processes=2), fit(backend="torch"), and torchrun with two processes -----------------
# Node 1, in a process of its own (process 1, torchrun's rank 1), raises at a drawn step, or its process is SIGKILLed
# (a process or machine dies) or SIGSTOPped (hung, or cut off by a partition: named within peer_timeout). The main
# process holds the run folder: its rows must be whole and consecutive, equal to the uninterrupted run's, the run
# must end as failed, and resuming must give the uninterrupted run's rows. The uninterrupted run is the one-process
# run above: a run over processes=2, the torch backend or torchrun gives its rows bit for bit (the sim-vs-torch and
# 1-vs-P equivalences), so the comparison shows that too; torchrun with the torch backend gives other rows here
# (not looked into) and has an uninterrupted run of its own. Under torchrun,
# rank 0 (node 0, which holds the run folder) SIGSTOPped too ("node0-SIGSTOP"): rank 1 names it and ends; torchrun
# then kills rank 0, so the folder says nothing of how the run ended, and resuming gives the uninterrupted rows.
# Each run of the suite tries SUITE_CASES; EXOGYM_FAULT_LOOP=1 tries every case (the 10-loop check in
# docs/guarantees.md).
LAUNCHES = ("processes", "torchrun")
PROCESS_KINDS = ("raise", "SIGKILL", "SIGSTOP")
PROCESS_CASES = [(launch, kind) for launch in LAUNCHES for kind in PROCESS_KINDS] + [
    ("torch", "SIGSTOP"), ("torchrun-torch", "SIGSTOP"), ("torchrun", "node0-SIGSTOP")]
PROCESS_DRAWS = [(launch, kind, random.Random(f"{launch}-{kind}").randint(2, fault_run.MAX_STEPS // 2))
                 for launch, kind in PROCESS_CASES]
# A stopped process over each launcher that is quick to end (torchrun waits 30 s before it kills a stopped rank), and
# torchrun's raise case, which shows rank 1's rows reaching the run folder.
SUITE_CASES = {("processes", "SIGSTOP"), ("torch", "SIGSTOP"), ("torchrun", "raise"), ("torchrun", "SIGSTOP")}
# In the suite, a resume under torchrun (a torchrun job of its own) is shown once, by its SIGSTOP case; the loop
# resumes every case.
RESUMED_ELSEWHERE = set() if os.environ.get("EXOGYM_FAULT_LOOP") else {("torchrun", "raise")}
if not os.environ.get("EXOGYM_FAULT_LOOP"):
    PROCESS_DRAWS = [d for d in PROCESS_DRAWS if d[:2] in SUITE_CASES]


def _run(launch: str, kind: str, step: int, where: Path, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(fault_run.command(kind, step, launch), cwd=where, env=env, capture_output=True, text=True,
                          timeout=timeout)


AS_ONE_PROCESS = ("processes", "torch", "torchrun")  # launches whose uninterrupted rows are one process's


def _stopped_run(launch: str, kind: str, step: int, where: Path) -> str:
    """Run the faulty run to its stop and return what it said: under torchrun a job of its own; over processes=2 or
    the torch backend from this process (node 1 lives in a process of its own), which must raise."""
    if launch.startswith("torchrun"):
        out = _run(launch, kind, step, where)
        assert out.returncode != 0, f"the {kind} at step {step} did not stop the run"
        return out.stderr
    with pytest.raises(Exception) as info:  # noqa: PT011 (each kind's error is checked in the run folder)
        fault_run.fit(kind, step, **fault_run.options(kind, launch))
    return "".join(traceback.format_exception(info.value))


@pytest.fixture(scope="module")
def uninterrupted_over(tmp_path_factory, uninterrupted):
    runs: dict[str, list[dict[str, str]]] = {launch: uninterrupted for launch in AS_ONE_PROCESS}

    def rows(launch: str) -> list[dict[str, str]]:
        if launch not in runs:
            where = tmp_path_factory.mktemp(f"uninterrupted-{launch}")
            done = _run(launch, "none", 0, where)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[launch] = table(where / "logs" / "r")
        return runs[launch]
    return rows


@pytest.mark.spawns
@pytest.mark.parametrize("launch, kind, step", PROCESS_DRAWS, ids=[f"{l}-{k}-at-step-{s}" for l, k, s in PROCESS_DRAWS])
def test_a_process_lost_at_a_random_step_loses_nothing_the_run_completed(launch, kind, step, tmp_path,
                                                                        uninterrupted_over):
    uninterrupted = uninterrupted_over(launch)
    assert len(uninterrupted) == fault_run.MAX_STEPS
    stderr = _stopped_run(launch, kind, step, tmp_path)
    run = tmp_path / "logs" / "r"
    rows = table(run)
    steps = [int(r["step"]) for r in rows]
    assert steps == list(range(1, len(steps) + 1)), stderr[-3000:]
    if kind == "raise":  # every step both nodes completed: node 1 stopped in step `step`
        assert len(steps) == step - 1, stderr[-3000:]
    elif kind != "node0-SIGSTOP":  # rows are flushed every 10 steps and at each checkpoint: those flushed before
        assert len(steps) >= (step - 1) // fault_run.CHECKPOINT_INTERVAL * fault_run.CHECKPOINT_INTERVAL, \
            stderr[-3000:]  # the loss are all there (rank 0, stopped, wrote what it wrote before)
    for r, expected in zip(rows, uninterrupted):
        assert [r[k] for k in COMPARED] == [expected[k] for k in COMPARED]
    timeout = f"(fit's peer_timeout={fault_run.PEER_TIMEOUT:g})"  # named within it (node_timeout is far longer)
    if kind == "node0-SIGSTOP":  # rank 1 named rank 0 and ended; torchrun then killed rank 0, which recorded nothing
        assert "PeerLostError: process 0 (node 0) stopped responding" in stderr and timeout in stderr, \
            stderr[-3000:]
        assert json.loads((run / ".exogym-run").read_text())["status"] == "running"  # to resume
    else:
        assert (run / "summary.json").exists(), stderr[-6000:]  # rank 0 recorded how the run ended
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "failed" and summary["steps"] == len(steps), summary
        if kind == "SIGSTOP":
            assert "PeerLostError: process 1 (node 1) stopped responding" in summary["error"], summary["error"]
            assert timeout in summary["error"] and summary["lost_peer"] == {"process": 1, "nodes": [1]}, summary
        elif kind == "raise":
            assert "RuntimeError: example" in summary["error"], summary["error"]
    if step - 1 < fault_run.CHECKPOINT_INTERVAL or (launch, kind) in RESUMED_ELSEWHERE:
        return  # stopped before its first checkpoint: nothing to resume from (or resumed by another case)
    if launch.startswith("torchrun"):
        resumed = _run(launch, "resume", 0, tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    else:  # processes=2 or the torch backend, started from this process
        fault_run.resume(str(run), launch)
    assert [[r[k] for k in COMPARED] for r in table(run)] == [[r[k] for k in COMPARED] for r in uninterrupted]
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


# ---- the edges of issue 46, in the loop only (EXOGYM_FAULT_LOOP=1) -------------------------------------------------
# A model of 1,000 tensors over processes=2 (each process once got one file descriptor per tensor: the forkserver
# refused it): node 1 raises at a drawn step, and resuming from the newest checkpoint over two processes gives the
# run that was never stopped. Async gossip over 1,024 nodes: it ends, each node's bytes are its pushes exactly
# (the end's bookkeeping is not traffic), and its end adds no memory to speak of.
LOOP_ONLY = pytest.mark.skipif(not os.environ.get("EXOGYM_FAULT_LOOP"), reason="issue 46's edges: in the "
                               "EXOGYM_FAULT_LOOP=1 loop of docs/guarantees.md")
FD_STEP = random.Random("fds").randint(3, 8)


class _FailingShard(torch.utils.data.Dataset):
    """Node 1's shard fails to read at `step` (batch 8, no shuffling); node 0's reads."""

    def __init__(self, rank, step):
        from toy import make_classification
        self.data, self.fail_at = make_classification(96, seed=rank), 8 * (step - 1) if rank == 1 else -1

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        if i == self.fail_at:
            raise RuntimeError(f"example {i} cannot be read")
        return self.data[i]


class _Shards:
    def __init__(self, step):
        self.step = step

    def __call__(self, rank, num_nodes, is_val):
        return _FailingShard(rank, self.step)


@LOOP_ONLY
@pytest.mark.spawns
def test_a_model_of_1000_tensors_over_two_processes_stopped_at_a_random_step_resumes_to_the_same_run(tmp_path):
    from exogym import Trainer
    from exogym.strategy import DiLoCoStrategy
    from exogym.strategy.optim import OptimSpec
    from test_many_tensors_processes import ManyTensors

    def fit(shards, processes, **kw):
        t = Trainer(ManyTensors(), shards)
        model = t.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.1), H=2), 2, max_steps=10, batch_size=8,
                      shuffle=False, progress=False, logger=False, processes=processes, **kw)
        return t, model

    whole, whole_model = fit(_Shards(step=10**6), 1)
    with pytest.raises(Exception, match=f"example {8 * (FD_STEP - 1)} cannot be read"):
        fit(_Shards(FD_STEP), 2, checkpoint_interval=2, checkpoint_dir=tmp_path)
    newest = find_checkpoint(tmp_path)
    resumed, resumed_model = fit(_Shards(step=10**6), 2, resume_from=newest)
    assert all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    assert resumed.record.node_loss == whole.record.node_loss


@LOOP_ONLY
def test_async_gossip_over_1024_nodes_ends_with_its_pushes_as_its_bytes():
    import resource
    from exogym import Trainer
    from exogym.strategy import GossipStrategy
    from toy import TinyMLP, make_classification
    model = TinyMLP()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t = Trainer(model, make_classification(4096))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t.fit(GossipStrategy(topology="ring", mode="async", H=1, lr=0.05), 1024, max_steps=4, batch_size=4,
          progress=False, logger=False)
    assert t.record.bytes_per_node == [4 * (model_bytes + 8)] * 1024
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grew_mb < 2000, grew_mb  # the K x K matrices of before took 10 GB here


@pytest.mark.spawns
@pytest.mark.skipif(not os.environ.get("EXOGYM_FAULT_LOOP"), reason="a case of the loop (EXOGYM_FAULT_LOOP=1): "
                    "about a minute on 2 cores")
def test_a_thousand_nodes_with_a_server_over_two_processes_end_without_a_false_deadlock():
    """Issue 46 (3): AsyncDiLoCo on 1,024 nodes over two processes ended about 2 runs in 12 with 'deadlock across
    processes ... node 512: waits in read_server' while process 1's questions were still on their way to the keeper;
    the run completes, with one process's updates."""
    import toy
    from exogym import Trainer
    from exogym.strategy import AsyncDiLoCoStrategy

    t = Trainer(toy.TinyMLP(), toy.make_classification(4096))
    t.fit(AsyncDiLoCoStrategy(H=5, lr=1e-2), 1024, max_steps=20, processes=2, batch_size=4, progress=False,
          logger=False, device="cpu")
    assert len(t.record.updates) == 1024 * 20 // 5
