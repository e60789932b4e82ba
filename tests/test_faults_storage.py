"""Storage faults (issue 30): a checkpoint folder belongs to one run; a full disk is a clear, early, lossless
failure; nothing outside the log folder is written or deleted; a manifest that is not a JSON object is a corrupt
checkpoint; run names obey one rule."""

import errno
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import exogym
import toy
from exogym import Trainer
from exogym.runs.checkpoint import CheckpointError, CheckpointPlan, read_manifest
from exogym.runs.disk import AppendFile, DiskFullError, disk_full, is_disk_full
from exogym.runs.folder import MARKER, RunFolderError, check_run_name, claim_run
from exogym.runs.loggers import CSVLogger, Logger, MultiLogger
from exogym.strategy import OptimSpec, SimpleReduceStrategy
from small_disk import run_on_small_disk, small_disk_unavailable

TESTS = Path(__file__).resolve().parent
FIT = dict(batch_size=8, progress=False, device="cpu")


class Untouchable(toy.TinyMLP):
    """Fails the test if any node ever runs a forward pass: the error must come before any node starts."""

    def forward(self, batch):
        raise AssertionError("a node started")


def _fit(model=None, **kwargs):
    strategy = SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2))
    return Trainer(model or toy.TinyMLP(), toy.make_classification(96)).fit(strategy, 2, **{**FIT, **kwargs})


def _names(folder):
    return sorted(p.name for p in Path(folder).iterdir())


# ---- a full disk ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """What the scenarios of tests/small_disk.py saw on a 768 KB tmpfs (run once for this module)."""
    why = small_disk_unavailable()
    if why is not None:
        pytest.skip(f"no small filesystem to fill: {why}")
    return run_on_small_disk(tmp_path_factory.mktemp("disk") / "mnt", 768)


@pytest.mark.spawns
def test_too_little_space_at_the_start_is_refused_before_anything_is_written(small_disk):
    report, _ = small_disk
    for seen in (report["probe"], report["tiny_fit"]):
        assert seen["type"] == "DiskFullError" and seen["errno"] == errno.ENOSPC
        assert re.fullmatch(r"disk full: the log folder '.*logs' needs at least 64.0 KB but its disk has 16.0 KB free; "
                            r"free space on that disk or write to a folder on another disk", seen["message"])
    assert report["tiny_left"] == []  # no run folder, no empty config.json blocking the name
    assert report["big_fit"]["type"] == "DiskFullError"  # config.json larger than the free space
    assert re.match(r"disk full: the run's config 'logs/big/config.json' needs 196.1 KB but its disk has 9\d.0 KB free",
                    report["big_fit"]["message"])
    assert report["big_left"] is False
    assert report["names_free"] == [2, 2]  # both names trained 2 rows once space was freed


@pytest.mark.spawns
def test_a_disk_filled_by_checkpoints_fails_naming_the_file_and_keeps_the_newest_complete_one(small_disk):
    report, _ = small_disk
    failed = report["ck_fit"]
    assert failed["type"] == "DiskFullError" and failed["errno"] == errno.ENOSPC
    assert re.fullmatch(r"disk full: node \d's checkpoint file 'ck/step_(\d{9}).partial/node\d.pt' needs at least "
                        r"[\d.]+ KB but its disk has [\d.]+ KB free; free space on that disk or write to a folder on "
                        r"another disk; the newest complete checkpoint, 'ck/step_\d{9}', is kept", failed["message"])
    complete = report["ck_listing"]
    assert complete and all(re.fullmatch(r"step_\d{9}", name) for name in complete)  # no .partial, no marker left
    newest = int(complete[-1][len("step_"):])
    assert report["ck_loaded_step"] == [newest, newest]  # it loads, every node at its step
    csv = report["ck_train_csv"]
    assert csv["ends_with_newline"] and len(csv["fields"]) == 1 and csv["rows"] >= newest
    assert report["ck_marker"]["status"] == "failed"
    assert report["ck_summary"]["status"] == "failed" and "DiskFullError: disk full:" in report["ck_summary"]["error"]


@pytest.mark.spawns
def test_torch_saves_own_failure_on_a_full_disk_is_a_disk_full_error_and_leaves_no_partial_folder(small_disk):
    report, _ = small_disk
    # 300 one-float tensors: 1.2 KB of tensors, which the check before the write lets through, in a file of
    # ~60 KB, which torch.save cannot write into 8 KB: its RuntimeError ("unexpected pos") is recognised.
    assert report["raw_save"]["type"] == "DiskFullError"
    assert re.fullmatch(r"disk full: node 0's checkpoint file '.*/raw/step_000000001.partial/node0.pt' needs more "
                        r"than the 8.0 KB free on its disk \(at least 1.2 KB\); free space on that disk or write to a "
                        r"folder on another disk", report["raw_save"]["message"])
    assert report["raw_left"] == []


@pytest.mark.spawns
def test_a_checkpoint_folder_short_of_one_checkpoint_is_refused_before_any_node_starts(small_disk):
    report, _ = small_disk
    assert re.fullmatch(r"not enough disk space for one checkpoint: checkpoint_dir '.*ck2' needs at least 602.0 KB "
                        r"\(num_nodes=2 x 301.0 KB of model state, before the optimizer's\) but its disk has 200.0 KB "
                        r"free; free space there, pass a checkpoint_dir on another disk, or drop checkpoint_interval",
                        report["space"]["message"])
    assert report["space_fit"]["type"] == "DiskFullError" and "needs at least 601.5 KB" in report["space_fit"]["message"]
    assert report["space_fit_forwards"] == 0 and report["space_left"] is False


@pytest.mark.spawns
def test_a_full_log_disk_leaves_whole_rows_and_a_failed_marker_and_finish_does_not_raise(small_disk):
    report, stderr = small_disk
    assert report["rows_fit"]["type"] == "DiskFullError"
    assert re.fullmatch(r"disk full: the train table 'logs/rows/train.csv' needs [\d.]+ KB but its disk has \d+ "
                        r"bytes free; .*", report["rows_fit"]["message"])
    csv = report["rows_csv"]
    assert csv["rows"] > 0 and csv["ends_with_newline"] and len(csv["fields"]) == 1  # as many cells in every line
    assert report["rows_marker"]["status"] == "failed"  # rewritten in place: no block was free for a new file
    assert "exogym: the run's summary was not written: disk full: the run's summary 'logs/rows/summary.json'" in stderr


@pytest.mark.spawns
def test_a_failed_append_is_cut_back_and_a_release_needs_no_free_block(small_disk):
    report, _ = small_disk
    assert report["append"]["type"] == "DiskFullError" and report["append"]["needed"] == 20_004
    assert report["append_left"] == "a,b\n"  # the header, whole; nothing of the row that did not fit
    assert report["free_at_release"] == 0
    assert report["released"]["status"] == "failed" and report["released"]["reason"] == "disk full: a test"


def test_a_row_cut_off_mid_write_is_truncated_back_to_the_last_whole_row(tmp_path, monkeypatch):
    table = AppendFile(tmp_path / "t.csv", "the t table", fresh=True)
    table.append("step,loss\r\n")
    calls = []

    def fills_up(fd, data):  # the first 4 bytes land, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return os.pwrite(fd, bytes(data[:4]), os.fstat(fd).st_size)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("exogym.runs.disk.os.write", fills_up)
    with pytest.raises(DiskFullError, match=r"disk full: the t table '.*t.csv' needs .*14 bytes"):
        table.append("1,0.123456789\n")
    monkeypatch.undo()
    table.close()
    assert calls == [14, 10] and (tmp_path / "t.csv").read_bytes() == b"step,loss\r\n"


def test_the_disk_full_error_is_an_oserror_that_crosses_processes():
    e = disk_full("/x/node1.pt", "node 1's checkpoint file", needed=2048, free=1024)
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC and e.filename == "/x/node1.pt"
    assert str(e) == ("disk full: node 1's checkpoint file '/x/node1.pt' needs 2.0 KB but its disk has 1.0 KB free; "
                      "free space on that disk or write to a folder on another disk")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is DiskFullError and str(back) == str(e) and (back.needed, back.free) == (2048, 1024)
    assert exogym.DiskFullError is DiskFullError
    saving = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert is_disk_full(saving, "/x", needed=40_000, free=30_000)  # did not fit
    assert not is_disk_full(saving, "/x", needed=40_000, free=10 ** 9)  # had room: another failure
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"), "/x")


def test_finish_never_raises_over_the_runs_own_error(tmp_path, capsys):
    lg = CSVLogger(tmp_path / "logs", "r")
    lg.start({"strategy": "S"})
    lg.log("train", {"step": 1, "loss": 0.5})
    (tmp_path / "logs" / "r" / "summary.json").mkdir()  # summary.json cannot be written
    lg.finish({"status": "failed", "error": "RuntimeError: boom"})
    assert "exogym: the run's summary was not written" in capsys.readouterr().err
    marker = json.loads((tmp_path / "logs" / "r" / MARKER).read_text())
    assert marker["status"] == "failed" and marker["reason"] == "RuntimeError: boom"

    class Broken(Logger):
        def finish(self, summary):
            raise RuntimeError("the service is down")

    after = CSVLogger(tmp_path / "logs", "m")
    both = MultiLogger([Broken(), after])
    both.start({"strategy": "S"})
    both.log("train", {"step": 1, "loss": 0.5})
    both.finish({"status": "failed", "error": "ValueError: the run's own"})  # said, not raised
    assert "Broken could not finish: RuntimeError: the service is down" in capsys.readouterr().err
    assert (tmp_path / "logs" / "m" / "summary.json").exists()  # the next logger still finished
    again = MultiLogger([Broken(), CSVLogger(tmp_path / "logs", "c")])
    again.start({"strategy": "S"})
    with pytest.raises(RuntimeError, match="the service is down"):  # a completed run: nothing hides it
        again.finish({"status": "completed"})


# ---- a checkpoint folder belongs to one run -----------------------------------------------------------------------

_FIRST = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import torch, toy
    from exogym import Trainer
    from exogym.strategy import OptimSpec, SimpleReduceStrategy
    ck = Path(sys.argv[2])

    class WaitsAfterTheFirstCheckpoint(toy.TinyMLP):
        def forward(self, batch):
            if (ck / "step_000000002" / "manifest.json").exists() and not Path("released").exists():
                Path("ready").touch()
                deadline = time.monotonic() + 120
                while not Path("released").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return super().forward(batch)

    strategy = SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2))
    Trainer(WaitsAfterTheFirstCheckpoint(), toy.make_classification(96)).fit(
        strategy, 2, batch_size=8, max_steps=6, checkpoint_interval=2, keep_checkpoints=10, checkpoint_dir=ck,
        run_name="first", progress=False, device="cpu")
""")


@pytest.mark.spawns
def test_a_second_run_is_refused_while_the_first_writes_into_the_checkpoint_folder(tmp_path):
    ck = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-c", _FIRST, str(TESTS), str(ck)], cwd=tmp_path,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert first.poll() is None, first.stderr.read()
            assert time.monotonic() < deadline, "the first run never reached its first checkpoint"
            time.sleep(0.02)
        before = _names(ck)
        assert before == [MARKER, "step_000000002"]
        for overwrite in (False, True):
            with pytest.raises(CheckpointError, match=rf"checkpoint_dir '.*ck' is in use by a run that has not ended "
                                                      rf"\(run 'first', run id \w+, running, started .* by process "
                                                      rf"{first.pid} on .*overwrite=True is refused too"):
                _fit(Untouchable(), max_steps=4, checkpoint_interval=2, checkpoint_dir=ck, run_name="second",
                     overwrite=overwrite)
        assert _names(ck) == before and not Path("logs/second").exists()
    finally:
        (tmp_path / "released").touch()
        first.wait(timeout=120)
    assert first.returncode == 0, first.stderr.read()
    assert _names(ck) == ["step_000000002", "step_000000004", "step_000000006"]  # all of them, and its own only


def test_another_runs_checkpoints_name_it_and_only_overwrite_replaces_them():
    _fit(max_steps=4, checkpoint_interval=2, checkpoint_dir="ck", run_name="first")
    first = read_manifest(Path("ck/step_000000004"))["run_id"]
    with pytest.raises(CheckpointError, match=rf"checkpoint_dir 'ck' holds checkpoints of another run \(step_000000004 "
                                              rf"of run 'first', run id {first}, written by process {os.getpid()} on "
                                              rf"{re.escape(socket.gethostname())}, which has ended\); resume it with "
                                              r"resume_from='ck', .* or pass overwrite=True to delete them"):
        _fit(Untouchable(), max_steps=2, checkpoint_interval=2, checkpoint_dir="ck", run_name="second")
    assert _names("ck") == ["step_000000002", "step_000000004"] and not Path("logs/second").exists()
    (Path("ck") / "step_000000005.partial").mkdir()  # unfinished, of the first run: replaced along with it
    _fit(max_steps=2, checkpoint_interval=2, checkpoint_dir="ck", run_name="second", overwrite=True)
    assert _names("ck") == ["step_000000002"] and read_manifest(Path("ck/step_000000002"))["run_name"] == "second"


@pytest.mark.spawns
def test_unfinished_checkpoints_are_removed_only_by_the_run_that_left_them():
    ck = Path("ck")
    (ck / "step_000000099.partial").mkdir(parents=True)  # another run's, there before this one
    _fit(max_steps=6, checkpoint_interval=2, checkpoint_dir=ck, logger=False)
    assert _names(ck) == ["step_000000002", "step_000000004", "step_000000006", "step_000000099.partial"]
    # As if this run had been killed while saving step 5: its marker and its .partial folder stay behind.
    run_id = read_manifest(ck / "step_000000004")["run_id"]
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (ck / MARKER).write_text(json.dumps({"run_id": run_id, "status": "running", "pid": int(gone.stdout),
                                         "host": socket.gethostname(), "kind": "checkpoints",
                                         "partials_of_others": ["step_000000099.partial"]}))
    (ck / "step_000000005.partial").mkdir()
    _fit(max_steps=6, checkpoint_interval=2, checkpoint_dir=ck, logger=False, resume_from=ck / "step_000000004")
    assert _names(ck) == ["step_000000002", "step_000000004", "step_000000006", "step_000000099.partial"]


def test_a_run_that_never_starts_gives_its_checkpoint_folder_back():
    class FailsToStart(Logger):
        def start(self, config):
            raise RuntimeError("the logging service refused")

    with pytest.raises(RuntimeError, match="the logging service refused"):
        _fit(max_steps=2, checkpoint_interval=1, checkpoint_dir="made/ck", logger=FailsToStart())
    assert not Path("made").exists()
    plan = CheckpointPlan(Path("kept"), 1, 1, {"num_nodes": 2, "run_name": "r"}, "id1", {})
    Path("kept").mkdir()
    claim = plan.check_owner()
    assert json.loads(Path("kept", MARKER).read_text())["kind"] == "checkpoints"
    claim.release("completed")
    assert _names("kept") == []  # the marker goes; a folder that was there before stays


def test_a_resumed_run_that_never_starts_puts_its_folders_marker_back(tmp_path):
    folder = tmp_path / "logs" / "r"
    folder.mkdir(parents=True)
    (folder / "train.csv").write_text("step,loss\n1,0.5\n")
    ended = json.dumps({"run_id": "old", "status": "failed", "pid": os.getpid(), "host": socket.gethostname(),
                        "time": "2026-01-01 00:00:00", "started": "2026-01-01 00:00:00", "reason": "killed"}) + "\n"
    (folder / MARKER).write_text(ended)
    claim = claim_run([tmp_path / "logs"], "r", "unused", resume=True)
    assert json.loads((folder / MARKER).read_text())["status"] == "running"
    claim.abandon()
    assert (folder / MARKER).read_text() == ended and _names(folder) == [MARKER, "train.csv"]


# ---- nothing outside the log folder -------------------------------------------------------------------------------

def test_a_linked_run_folder_is_refused_and_nothing_behind_it_is_touched():
    outside = Path("outside")
    outside.mkdir()
    (outside / "precious.txt").write_text("days of compute")
    Path("logs").mkdir()
    os.symlink("../outside", "logs/victim")
    for overwrite in (True, False):
        with pytest.raises(RunFolderError, match=r"the run folder 'logs/victim' is a symbolic link to '../outside'; "
                                                 r"exogym .* does not follow it: remove the link, or choose another "
                                                 r"run_name"):
            _fit(Untouchable(), max_steps=2, run_name="victim", overwrite=overwrite)
    (outside / "precious.txt").rename("precious.txt")  # an empty target: still nothing written through the link
    with pytest.raises(RunFolderError, match="is a symbolic link"):
        _fit(Untouchable(), max_steps=2, run_name="victim")
    assert _names(outside) == [] and Path("precious.txt").read_text() == "days of compute"


def test_links_inside_a_replaced_run_folder_are_unlinked_not_followed(tmp_path):
    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "shard.bin").write_bytes(b"\1\2")
    (outside / "notes.txt").write_text("mine")
    _fit(max_steps=2, run_name="r")
    os.symlink(outside / "data", "logs/r/data")
    os.symlink(outside / "notes.txt", "logs/r/notes.txt")
    Path("logs/r/sub").mkdir()
    os.symlink(outside, "logs/r/sub/deeper")
    _fit(max_steps=3, run_name="r", overwrite=True)
    assert (outside / "data" / "shard.bin").read_bytes() == b"\1\2" and (outside / "notes.txt").read_text() == "mine"
    assert not any(p.is_symlink() for p in Path("logs/r").rglob("*"))


def test_a_linked_checkpoint_folder_is_refused_with_overwrite(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "step_000000002").mkdir()  # someone's checkpoint there
    os.symlink(target, "ck")
    with pytest.raises(CheckpointError, match=rf"checkpoint_dir 'ck' is a symbolic link to '{re.escape(str(target))}'; "
                                              r"overwrite=True deletes checkpoints only inside a real folder"):
        _fit(Untouchable(), max_steps=2, checkpoint_interval=1, checkpoint_dir="ck", overwrite=True)
    assert _names(target) == ["step_000000002"]


# ---- manifests and names ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[]", "3", "null"])
def test_a_manifest_that_is_not_a_json_object_is_a_corrupt_checkpoint(text):
    _fit(max_steps=4, checkpoint_interval=4, checkpoint_dir="ck", logger=False)
    Path("ck/step_000000004/manifest.json").write_text(text)
    for execution in ("sequential", "auto"):  # ("auto" reads the manifest first, for the execution it recorded)
        with pytest.raises(CheckpointError, match=r"the manifest 'ck/step_000000004/manifest.json' is not a JSON "
                                                  r"object"):
            _fit(Untouchable(), max_steps=6, resume_from="ck", execution=execution, logger=False)
    with pytest.raises(CheckpointError, match=r"holds checkpoints of another run \(step_000000004 whose manifest is "
                                              r"unreadable\)"):
        _fit(Untouchable(), max_steps=4, checkpoint_interval=4, checkpoint_dir="ck", logger=False)


BAD_NAMES = [("", "it is empty"), ("   ", "it is only spaces"), (".", "'.' is not a folder of its own"),
             ("..", "'..' is not a folder of its own"), ("a/b", "it holds a path separator"),
             ("a\nb", r"it holds a control character \('\\n'\)"), ("a\tb", r"it holds a control character \('\\t'\)"),
             ("a\0b", r"it holds a control character \('\\x00'\)"),
             ("a\u2028b", r"it holds a line separator \('\\u2028'\)"), ("x" * 101, "it has 101 characters"),
             ("\u65e5" * 67, "it has 201 bytes as UTF-8"), (3, "got a int")]


@pytest.mark.parametrize("name, why", BAD_NAMES)
def test_a_run_name_breaking_the_rule_is_refused_saying_the_rule(name, why):
    rule = (r"; a run name is one folder name: 1 to 100 characters \(200 bytes as UTF-8\), not only spaces, not '.' "
            r"or '..', with no '/' and no control characters \(newline, tab, NUL\)")
    with pytest.raises(ValueError, match=rf"^run_name must be a folder name: {why}, got .*{rule}"):
        check_run_name(name)


def test_run_names_at_the_limits_are_accepted_and_the_api_and_logger_use_the_rule():
    for name in ("x" * 100, "\u65e5" * 66, "run 1", "exp-01.lr3e-4", "\u00fcn\u00efc\u00f6d\u00e9"):
        assert check_run_name(name) == name
    for name in ("", "..", "a\nb"):
        with pytest.raises(ValueError, match="run_name must be a folder name"):
            _fit(Untouchable(), max_steps=2, run_name=name)
        with pytest.raises(ValueError, match="run_name must be a folder name"):
            CSVLogger("logs", name)
    assert not Path("logs").exists()
    _fit(max_steps=1, run_name="\u00fcn\u00efc\u00f6d\u00e9 " + "x" * 90)
    assert Path("logs", "\u00fcn\u00efc\u00f6d\u00e9 " + "x" * 90, "train.csv").exists()
