"""Sweeps that stop and start again: two workers racing for trials, a worker killed with SIGKILL in the middle of
a run and the sweep resumed (every configuration exactly once, the killed run from its checkpoint), and the
command line's --resume."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exogym.sweep import grid, load, sweep
from sweep_runs import slow, take_all

optuna = pytest.importorskip("optuna")
HERE = Path(__file__).parent


def test_two_workers_never_take_the_same_trial(tmp_path):
    from exogym.sweep.objective import Objective
    from exogym.sweep.study import StudyLedger

    url = f"sqlite:///{tmp_path / 'study.db'}"
    StudyLedger(url, "race", grid(i=list(range(30))), Objective(), search="grid", trials=None, create=True)
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)  # both take from the same moment on
    procs = [context.Process(target=take_all, args=(url, "race", str(tmp_path / f"taken{i}"), start))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    taken = [[int(t) for t in (tmp_path / f"taken{i}").read_text().split()] for i in range(2)]
    assert sorted(taken[0] + taken[1]) == list(range(30))  # every trial taken once, none twice
    assert all(taken)  # both workers took some: they did race


def _checkpointed_run(runs: Path) -> Path | None:
    """A run folder with a complete checkpoint whose run has not ended yet."""
    for folder in runs.glob("*"):
        if any(folder.glob("checkpoints/step_*/manifest.json")) and not (folder / "summary.json").exists():
            return folder
    return None


def test_a_worker_killed_mid_run_loses_only_that_run_and_resume_runs_it_from_its_checkpoint(tmp_path):
    out = tmp_path / "s"
    sweep_proc = subprocess.Popen([sys.executable, "-c", "import sys, sweep_runs; sweep_runs.kill_sweep(sys.argv[1])",
                                   str(out)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(HERE)})
    deadline, victim = time.monotonic() + 120, None
    while victim is None and time.monotonic() < deadline and sweep_proc.poll() is None:
        victim = _checkpointed_run(out / "runs")
        time.sleep(0.05)
    assert victim is not None, "no run reached a checkpoint"
    pid = json.loads((victim / ".exogym-run").read_text())["pid"]  # the worker process running it
    os.kill(pid, signal.SIGKILL)
    assert sweep_proc.wait(180) == 0  # the other worker finishes the rest

    space = grid(H=[2, 4, 5], seed=[0])
    finished = {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    rows = sweep(slow, space, out=out, checkpoint_interval=5, resume=True, progress=False).table()
    assert sorted(r["H"] for r in rows) == [2, 4, 5]  # every configuration exactly once
    assert all(r["status"] == "completed" and r["seeds"] == 1 for r in rows)
    killed = next(r for r in rows if Path(r["run_dirs"]) == victim)
    assert killed["attempts"] == 2 and all(r["attempts"] == 1 for r in rows if r is not killed)
    assert "resumed" in json.loads((victim / "config.json").read_text())  # from its checkpoint, not from scratch
    assert {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")
            if p.parent != victim} == finished  # finished runs were not run again
    for r in rows:  # each run's rows once: no two workers ran it, and the resumed run continued its own file
        with open(Path(r["run_dirs"]) / "train.csv") as f:
            assert [int(line.split(",")[0]) for line in list(f)[1:]] == list(range(1, 31))
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(Path(r["run_dirs"]).name for r in rows)


def test_the_command_line_sweeps_resumes_and_refuses_what_it_cannot_do(tmp_path, capsys):
    from exogym.cli import main

    args = ["sweep", "--task", "synthetic", "--strategies", "ddp", "diloco", "--H", "5", "10", "--outer-lr", "0.7",
            "--nodes", "2", "--steps", "10", "--val-size", "64", "--seeds", "0", "1", "--quiet", "--out", "s"]
    assert main(args) == 0
    rows = (tmp_path / "s" / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 3  # DDP once (it takes no H), DiLoCo at H 5 and 10
    marks = {p: p.stat().st_mtime_ns for p in (tmp_path / "s" / "runs").glob("*/summary.json")}
    assert len(marks) == 6
    assert main(["sweep", "--resume", "s", "--quiet"]) == 0
    assert marks == {p: p.stat().st_mtime_ns for p in (tmp_path / "s" / "runs").glob("*/summary.json")}
    assert main(["sweep", "--task", "synthetic", "--search", "random", "--trials", "2", "--H", "2:8:log", "--outer-lr",
                 "0.3:0.9", "--nodes", "2", "--steps", "6", "--val-size", "64", "--quiet", "--out", "r"]) == 0
    searched = load(tmp_path / "r").table()
    assert sum(r["attempts"] for r in searched) == 2 and all(2 <= r["H"] <= 8 for r in searched)
    capsys.readouterr()
    for bad, match in [
        (["--strategies", "ddp", "--H", "5", "10", "--out", "t"], "--H: not an option of ddp"),
        (["--strategies", "diloco", "--H", "0", "5", "--out", "t"], "--H: must be >= 1, got 0"),
        (["--strategies", "diloco", "--H", "5:1:log", "--search", "tpe", "--trials", "2", "--out", "t"],
         "the range 5..1 is empty"),
        (["--strategies", "diloco", "--outer-lr", "0:1:log", "--search", "random", "--trials", "2", "--out", "t"],
         "must be > 0, got 0"),
        (["--objective", "val_los", "--out", "t"], "unknown objective 'val_los'"),
        (["--objective", "final_global_perplexity", "--out", "t"], "returns accuracy, loss, not perplexity"),
        (["--max-sim-time", "10", "--out", "t"], "needs the runs' simulated time|give the runs a network"),
        (["--resume", "s", "--steps", "20"], "--steps cannot change them"),
        (["--out", "s"], "holds a sweep already"),
    ]:
        assert main(["sweep", "--task", "synthetic", *bad]) == 2
        assert re.search(match, capsys.readouterr().err), match
    assert not (tmp_path / "t").exists()
