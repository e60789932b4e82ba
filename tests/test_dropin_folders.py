"""The run-folder pieces a rerun relies on (exogym.runs.folder): nothing is created before a run is claimed, a
claim given back removes what it created, and move_aside keeps an ended run under a name saying when it started."""

import json
import os
import socket

import pytest

from exogym.runs.folder import MARKER, RunFolderError, check_writable, claim_run, move_aside


def test_check_writable_creates_nothing_and_still_refuses_a_path_under_a_file(tmp_path):
    assert check_writable(tmp_path / "a" / "b", "checkpoint_dir") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(RunFolderError, match=r"checkpoint_dir '.*/f/ckpt' is not writable \(NotADirectoryError"):
        check_writable(tmp_path / "f" / "ckpt", "checkpoint_dir")


def test_a_claim_given_back_removes_the_folders_it_created_and_only_those(tmp_path):
    claim = claim_run([tmp_path / "new" / "logs"], "run", "default")
    assert (tmp_path / "new" / "logs" / "run" / MARKER).exists()
    claim.abandon()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    claim_run([tmp_path / "kept"], None, "default").abandon()
    assert list(tmp_path.iterdir()) == [tmp_path / "kept"]  # it existed before: kept


def _ended_run(folder, started="2026-01-02 03:04:05", status="completed", pid=None):
    folder.mkdir(parents=True)
    (folder / "train.csv").write_text("step,loss\n1,0.5\n")
    (folder / MARKER).write_text(json.dumps({"run_id": "r", "status": status, "pid": pid or os.getpid(),
                                             "host": socket.gethostname(), "time": "2026-01-02 09:00:00",
                                             "started": started}))


def test_move_aside_names_the_earlier_run_for_when_it_started_and_moves_its_checkpoints_along(tmp_path):
    _ended_run(tmp_path / "logs" / "exp")
    (tmp_path / "ckpt" / "exp" / "step_000000002").mkdir(parents=True)
    moved = move_aside([tmp_path / "logs" / "exp", tmp_path / "ckpt" / "exp", tmp_path / "tb" / "exp"])
    assert moved == [(tmp_path / "logs" / "exp", tmp_path / "logs" / "exp.20260102-030405"),
                     (tmp_path / "ckpt" / "exp", tmp_path / "ckpt" / "exp.20260102-030405")]
    assert (tmp_path / "logs" / "exp.20260102-030405" / "train.csv").exists()
    _ended_run(tmp_path / "logs" / "exp")  # the same start time again: the next free name
    assert move_aside([tmp_path / "logs" / "exp"])[0][1].name == "exp.20260102-030405-2"
    assert move_aside([tmp_path / "logs" / "exp"]) == []  # nothing there any more
    (tmp_path / "logs" / "empty").mkdir()
    assert move_aside([tmp_path / "logs" / "empty"]) == []


def test_move_aside_leaves_a_running_run_alone(tmp_path):
    _ended_run(tmp_path / "busy", status="running")  # this very process holds it: running
    assert move_aside([tmp_path / "busy"]) == [] and (tmp_path / "busy" / "train.csv").exists()
