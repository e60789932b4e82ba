"""Sweeps on a real database: a throwaway PostgreSQL 15 server (tests/pg_server.py), two workers from two working
directories sharing one study, the server stopped in the middle of a sweep and started again, a start whose
storage cannot work leaving nothing behind, and a grid's first trial queued twice (a machine resuming while the
maker sets up) running once. Skipped, with the reason, where PostgreSQL 15 or psycopg 3 is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import pg_server
from exogym.sweep import StorageUnavailable, grid, load, sweep
from sweep_runs import tiny

optuna = pytest.importorskip("optuna")
HERE = Path(__file__).parent
ROOT = HERE.parent
pytestmark = pytest.mark.skipif(pg_server.missing() is not None, reason=str(pg_server.missing()))


@pytest.fixture
def server():
    folder = Path(tempfile.mkdtemp(prefix="exogym-pg-"))  # not under pytest's tmp_path: the server's user reads it
    pg = pg_server.PgServer(folder)
    pg.start()
    try:
        yield pg
    finally:
        try:
            pg.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(folder, ignore_errors=True)


def _cli(cwd: Path, *args: str) -> subprocess.Popen:
    command = ["sweep", "--task", "synthetic", "--strategies", "diloco", "--nodes", "2", "--val-size", "64",
               "--quiet", *args]
    return subprocess.Popen([sys.executable, "-m", "exogym.cli", *command], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{HERE}"})


def _trials(url: str, name: str) -> list:
    study = optuna.load_study(study_name=name, storage=url)
    return study.get_trials(deepcopy=False)


@pytest.mark.spawns
def test_two_workers_from_two_folders_share_one_study_each_trial_once(server, tmp_path):
    grid_args = ["--H", "2", "3", "4", "5", "6", "7", "--steps", "20", "--storage", server.url,
                 "--study-name", "shared", "--out", "s"]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    procs = [_cli(tmp_path / "a", *grid_args), _cli(tmp_path / "b", *grid_args)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    trials = _trials(server.url, "shared")
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.params["H"] for t in done) == [2, 3, 4, 5, 6, 7]  # each exactly once
    for t in trials:  # the others: a worker that asked as the other took the last configuration, pruned at once
        assert t in done or (t.state == optuna.trial.TrialState.PRUNED and not t.params
                             and t.user_attrs["reason"] == "no configuration left")
    # Each run in one folder only. Which machine took how many depends on the host's scheduling (under load one
    # may take all six before the other starts), so it is not asserted; what each shows is.
    folders = [p.name for side in "ab" for p in (tmp_path / side / "s" / "runs").glob("*") if p.is_dir()]
    assert len(folders) == len(set(folders)) == 6
    for side in "ab":  # the table is complete from either folder
        rows = load(tmp_path / side / "s").table()
        assert sorted(r["H"] for r in rows) == [2, 3, 4, 5, 6, 7] and all(r["status"] == "completed" for r in rows)


@pytest.mark.spawns
def test_the_database_stopped_mid_sweep_and_started_again_loses_nothing_and_reruns_nothing(server, tmp_path):
    proc = _cli(tmp_path, "--H", "2", "3", "4", "5", "6", "--steps", "60", "--storage", server.url, "--out", "s")
    runs = tmp_path / "s" / "runs"
    deadline = time.monotonic() + 120
    while not list(runs.glob("*/summary.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(runs.glob("*/summary.json")), "no run finished"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    server.stop()
    # The database stays down until the sweep has met the outage (whatever the machine's load): a run that finished
    # meanwhile waits to write its outcome, or the worker waits to take its next configuration.
    deadline = time.monotonic() + 120
    while not any("unreachable" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)
    server.start()
    proc.wait(timeout=300)
    reader.join(30)
    err = "".join(lines)
    assert proc.returncode == 0, err
    assert "unreachable" in err and "127.0.0.1" in err and "retrying at" in err  # said, in one line each
    assert "internal error" not in err and "Traceback" not in err
    rows = load(tmp_path / "s").table()
    assert sorted(r["H"] for r in rows) == [2, 3, 4, 5, 6]
    assert all(r["status"] == "completed" and r["attempts"] == 1 for r in rows)  # none lost, none run again
    for folder in runs.iterdir():  # each run's rows once
        with open(folder / "train.csv") as f:
            assert [int(line.split(",")[0]) for line in list(f)[1:]] == list(range(1, 61))


@pytest.mark.spawns
def test_a_storage_that_cannot_work_is_one_line_and_leaves_no_folder(server, tmp_path):
    out = tmp_path / "s"
    for storage, error, match in [
        ("bogus://x", ValueError, "not a database URL SQLAlchemy knows"),
        ("postgresql://postgres@127.0.0.1:1/postgres", StorageUnavailable, "stayed unreachable for 2 s"),
    ]:
        with pytest.raises(error, match=match):
            sweep(tiny, grid(H=[2]), out=out, storage=storage, storage_patience=2, progress=False)
        assert not out.exists()  # nothing blocks the same command
    rows = sweep(tiny, grid(H=[2]), out=out, storage=server.url, progress=False).table()
    assert rows[0]["status"] == "completed"


@pytest.mark.spawns
def test_a_first_trial_queued_twice_on_a_database_runs_once(server, tmp_path, monkeypatch):
    # As tests/test_sweep_grid.py, on PostgreSQL: the maker and a machine resuming while it sets up each queue the
    # first trial; the later one is pruned when taken, and each configuration runs once.
    from exogym.sweep.grid_queue import GridQueue

    refill = GridQueue._refill

    def twice(self, start, end, *, check, first=False):
        refill(self, start, end, check=check, first=first)
        if first:
            refill(self, start, end, check=False, first=True)

    monkeypatch.setattr(GridQueue, "_refill", twice)
    rows = sweep(tiny, grid(H=[2, 3, 4]), out=tmp_path / "s", storage=server.url, progress=False).table()
    assert [(r["H"], r["status"], r["attempts"]) for r in rows] == [(2, "completed", 1), (3, "completed", 1),
                                                                    (4, "completed", 1)]
    trials = _trials(server.url, "exogym-s")
    assert sorted(t.params["H"] for t in trials if t.state == optuna.trial.TrialState.COMPLETE) == [2, 3, 4]
    assert [t.user_attrs["reason"] for t in trials if t.state == optuna.trial.TrialState.PRUNED] == ["queued twice"]
