"""A sweep that cannot start says what and where in one line and leaves nothing that blocks the next try: a start
interrupted while it sets up, a damaged study file, a full disk, settings every run would fail with, and --debug
after the subcommand."""

from __future__ import annotations

import errno
import re

import pytest

from exogym.cli.commands import main
from exogym.sweep import StorageUnavailable, grid, sweep
from exogym.sweep.storage import patient
from exogym.sweep.study import SweepStudy
from sweep_runs import tiny

pytest.importorskip("optuna")
SYNTHETIC = ["sweep", "--task", "synthetic", "--strategies", "diloco", "--steps", "5", "--val-size", "64", "--quiet"]


def test_a_start_interrupted_while_it_sets_up_leaves_no_folder(tmp_path, monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(SweepStudy, "queue_grid", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sweep(tiny, grid(H=[2, 3]), out=tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists()
    monkeypatch.undo()
    assert len(sweep(tiny, grid(H=[2, 3]), out=tmp_path / "s", progress=False).table()) == 2  # the same command


def test_a_damaged_study_file_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*SYNTHETIC, "--nodes", "2", "--H", "2", "3", "--out", "s"]) == 0
    journal = tmp_path / "s" / "study.journal"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:2] + ['{"op_code": 5, "worker_id": ???'] + lines[3:]) + "\n")
    capsys.readouterr()
    assert main(["sweep", "--resume", "s", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(journal) in err and "damaged" in err and "internal error" not in err


def test_a_full_disk_is_one_line_naming_the_file(tmp_path):
    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageUnavailable, match=re.escape(f"{tmp_path / 'study.journal'}: the disk is full")):
        patient(full, url=str(tmp_path / "study.journal"), patience=5)


def test_settings_every_run_would_fail_with_are_refused_before_any_trial(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad, match in [
        (["--nodes", "100000", "--out", "t"], r"--nodes 100000 --batch-size 32: .* fewer than one step needs"),
        (["--nodes", "2", "100000", "--H", *map(str, range(1, 101)), "--outer-lr",  # 20,000 configurations:
          *(f"{i / 100:.2f}" for i in range(1, 101)), "--out", "t"],  # each value checked, not each combination
         r"--nodes 100000 --batch-size 32: .* fewer than one step needs"),
        (["--storage", "bogus://x", "--out", "t"], "not a database URL SQLAlchemy knows"),
    ]:
        assert main([*SYNTHETIC, *bad]) == 2
        assert re.search(match, capsys.readouterr().err), match
        assert not (tmp_path / "t").exists()


def test_debug_after_the_subcommand_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="fewer than one step needs"):
        main([*SYNTHETIC, "--nodes", "100000", "--out", "t", "--debug"])


def test_a_trial_taken_just_as_the_storage_went_away_is_queued_again_not_lost(tmp_path, monkeypatch):
    # The storage fails right after a worker took a queued configuration and before it could mark it: that trial
    # stays RUNNING with no heartbeat, so Optuna never fails it as stale. Before, the sweep then waited forever
    # (on a database) or ended without that configuration; now the configuration is queued again and runs once.
    import optuna

    import exogym.sweep.study as study_module
    monkeypatch.setattr(study_module, "ORPHAN_AFTER_S", 0.0, raising=False)
    real_optimize, failed = optuna.study.Study.optimize, []

    def optimize_once_orphaning(self, *args, **kwargs):
        if not failed:
            failed.append(self.ask())  # takes the first queued configuration, unmarked by any worker
            raise ConnectionError("the storage went away")  # what patient() waits out and retries
        return real_optimize(self, *args, **kwargs)

    monkeypatch.setattr(optuna.study.Study, "optimize", optimize_once_orphaning)
    rows = sweep(tiny, grid(H=[2, 3]), out=tmp_path / "s", progress=False, storage_patience=30).table()
    assert failed and sorted(r["H"] for r in rows) == [2, 3]
    assert all(r["status"] == "completed" and r["attempts"] == 1 for r in rows)
