"""Sweeps that stop and start again: two workers racing for trials, a worker killed with SIGKILL in the middle of
a run and the sweep resumed (every configuration exactly once, the killed run from its checkpoint), and the
command line's --resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sweep_runs
from exogym.sweep import grid, load, sweep

optuna = pytest.importorskip("optuna")
HERE = Path(__file__).parent
ROOT = HERE.parent


def _checkpointed_run(runs: Path) -> Path | None:
    """A run folder with a complete checkpoint whose run has not ended yet."""
    for folder in runs.glob("*"):
        if any(folder.glob("checkpoints/step_*/manifest.json")) and not (folder / "summary.json").exists():
            return folder
    return None


def _wait_for_checkpointed_run(out: Path, proc: subprocess.Popen) -> Path:
    deadline, victim = time.monotonic() + 120, None
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        victim = _checkpointed_run(out / "runs")
        time.sleep(0.05)
    assert victim is not None, "no run reached a checkpoint"
    return victim


def _start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import sys, sweep_runs; sweep_runs.kill_sweep(*sys.argv[1:])",
                             str(out), *args], cwd=out.parent, env={**os.environ, "PYTHONPATH": f"{HERE}:{ROOT}"},
                            start_new_session=True)


@pytest.mark.spawns
def test_a_worker_killed_mid_run_is_replaced_and_its_configuration_reruns_from_its_checkpoint(tmp_path):
    out = tmp_path / "s"
    proc = _start(out)
    victim = _wait_for_checkpointed_run(out, proc)
    pid = json.loads((victim / ".exogym-run").read_text())["pid"]  # the worker process running it
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(180) == 0  # a new worker took the dead one's place, and its configuration ran again
    rows = load(out).table()
    assert sorted(r["H"] for r in rows) == [2, 4, 5]  # every configuration exactly once
    assert all(r["status"] == "completed" and r["seeds"] == 1 for r in rows)
    killed = next(r for r in rows if Path(r["run_dirs"]) == victim)
    assert killed["attempts"] == 2 and all(r["attempts"] == 1 for r in rows if r is not killed)
    assert "resumed" in json.loads((victim / "config.json").read_text())  # from its checkpoint, not from scratch
    for r in rows:  # each run's rows once: no two workers ran it, and the resumed run continued its own file
        with open(Path(r["run_dirs"]) / "train.csv") as f:
            assert [int(line.split(",")[0]) for line in list(f)[1:]] == list(range(1, 31))


@pytest.mark.spawns
def test_a_sweep_killed_outright_resumes_bit_identically_with_its_own_workers(tmp_path):
    # The reference: the same sweep left alone, in this process (one worker, the one thread the killed sweep's
    # workers have too: conftest sets OMP_NUM_THREADS=1 for the processes tests start).
    whole = tmp_path / "whole"
    sweep(sweep_runs.unslowed, grid(H=[2, 4, 5], seed=[0]), out=whole, checkpoint_interval=5, progress=False)
    out = tmp_path / "s"
    proc = _start(out)
    _wait_for_checkpointed_run(out, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its workers, at once
    proc.wait(30)
    finished = {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")}
    assert _start(out, "resume").wait(180) == 0  # resume=True, no workers given: the sweep's own 2
    assert json.loads((out / "sweep.json").read_text())["workers"] == 2
    rows, expected = load(out).table(), load(whole).table()
    assert [r["objective"] for r in rows] == [r["objective"] for r in expected]  # bit-identical
    assert all(r["status"] == "completed" for r in rows)
    assert {p.parent.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*/summary.json")
            if p.parent.name in finished} == finished  # finished runs were not run again


@pytest.mark.spawns
def test_a_script_without_the_main_guard_gets_one_line_naming_the_fix(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("from exogym.sweep import grid, sweep\nfrom sweep_runs import tiny\n"
                      f"sweep(tiny, grid(H=[2, 3]), workers=2, out={str(tmp_path / 's')!r}, progress=False)\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{HERE}:{ROOT}"})
    assert done.returncode != 0
    assert "put the sweep(...) call under `if __name__ == \"__main__\":`" in done.stderr
    assert "bootstrapping" not in done.stderr and done.stderr.count("Traceback") <= 1


def test_the_command_line_sweeps_resumes_and_refuses_what_it_cannot_do(tmp_path, capsys):
    from exogym.cli.commands import main

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


@pytest.mark.spawns
def test_a_sweep_run_stopped_by_sigterm_is_recorded_as_sigterm(tmp_path):
    # Issue 46: the sweep worker had a SIGTERM handler of its own raising a bare KeyboardInterrupt, so the run was
    # recorded as stopped by SIGINT. The worker now takes the launch layer's one handler.
    out = tmp_path / "s"
    proc = _start(out)
    victim = _wait_for_checkpointed_run(out, proc)
    os.kill(json.loads((victim / ".exogym-run").read_text())["pid"], signal.SIGTERM)
    proc.wait(180)
    summary = json.loads((victim / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM", summary
