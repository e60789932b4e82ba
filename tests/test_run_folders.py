"""A run folder belongs to one run: default names never collide, a taken explicit name is an error unless
overwrite=True or the run resumes itself, claims are atomic across processes, and bad folders fail early."""

import csv
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.cli.commands import main
from exogym.runs.loggers import CSVLogger, TensorBoardLogger, truncate_rows_after
from exogym.runs.folder import MARKER, RunFolderError, check_writable, claim_run
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(batch_size=8, val_interval=3, progress=False, device="cpu")


def _trainer(model=None):
    return Trainer(model or toy.TinyMLP(dropout=0.3), toy.make_classification(96),
                   toy.make_classification(24, seed=1))


def _strategy():
    return SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2), warmup_steps=2, cosine_anneal=True)


def _steps(path):
    with open(path) as f:
        return [int(float(r["step"])) for r in csv.DictReader(f)]


class Untouchable(toy.TinyMLP):
    """Fails the test if any node ever runs a forward pass: the error must come before any node starts."""

    def forward(self, batch):
        raise AssertionError("a node started")


def test_default_names_in_the_same_second_each_get_their_own_folder(monkeypatch):
    monkeypatch.setattr("exogym.runs.loggers.time.strftime", lambda fmt, *a: "20260101-000000")  # one second for all
    for lr in (0.1, 0.01, 0.001, 0.0001):
        _trainer().fit(SimpleReduceStrategy("sgd", lr=lr), 2, max_steps=3, **FIT)
    runs = sorted(p.name for p in Path("logs").iterdir())
    assert runs == ["SimpleReduceStrategy-2n-20260101-000000", "SimpleReduceStrategy-2n-20260101-000000-2",
                    "SimpleReduceStrategy-2n-20260101-000000-3", "SimpleReduceStrategy-2n-20260101-000000-4"]
    lrs = [json.loads((Path("logs") / r / "config.json").read_text())["strategy_config"]["lr"]
           for r in runs]
    assert lrs == [0.1, 0.01, 0.001, 0.0001]  # every run's log kept, each in its own folder
    assert all(_steps(Path("logs") / r / "train.csv") == [1, 2, 3] for r in runs)
    assert all(json.loads((Path("logs") / r / MARKER).read_text())["status"] == "completed" for r in runs)

    reused = CSVLogger("again")  # one logger object passed to several fits: a folder per run too
    for _ in range(2):
        _trainer().fit(_strategy(), 2, max_steps=2, logger=reused, **FIT)
    assert len(list(Path("again").iterdir())) == 2


def test_a_taken_explicit_name_moves_the_earlier_run_aside_unless_overwrite():
    _trainer().fit(_strategy(), 2, max_steps=6, run_name="exp", **FIT)
    before = Path("logs/exp/train.csv").read_text()
    with pytest.warns(UserWarning, match=r"logs/exp held an earlier run, which is kept, moved to logs/exp\.\d{8}-"):
        _trainer().fit(_strategy(), 2, max_steps=3, run_name="exp", **FIT)
    kept = [p for p in Path("logs").iterdir() if p.name != "exp"]
    assert len(kept) == 1 and (kept[0] / "train.csv").read_text() == before  # 6 rows, untouched, kept
    assert _steps("logs/exp/train.csv") == [1, 2, 3]
    Path("logs/exp", MARKER).write_text(Path("logs/exp", MARKER).read_text().replace('"completed"', '"running"'))
    with pytest.raises(RunFolderError, match="logs/exp"):  # a run still running there: refused, nothing moved
        _trainer(Untouchable()).fit(_strategy(), 2, max_steps=3, logger=CSVLogger(run_name="exp"), **FIT)
    Path("logs/exp", MARKER).write_text(Path("logs/exp", MARKER).read_text().replace('"running"', '"completed"'))

    _trainer().fit(_strategy(), 2, max_steps=3, run_name="exp", overwrite=True, **FIT)
    assert _steps("logs/exp/train.csv") == [1, 2, 3]  # replaced, as asked, not mixed
    assert json.loads(Path("logs/exp/config.json").read_text())["max_steps"] == 3


def test_folder_names_and_flags_are_validated():
    with pytest.raises(ValueError, match="run_name must be a folder name"):
        _trainer().fit(_strategy(), 2, max_steps=1, run_name="a/b", **FIT)
    with pytest.raises(ValueError, match=r"one run has one folder name, got fit\(run_name='a'\), a logger's "
                                         r"run_name='b'"):
        _trainer().fit(_strategy(), 2, max_steps=1, run_name="a", logger=CSVLogger(run_name="b"), **FIT)
    with pytest.raises(TypeError, match="overwrite must be True or False, got 'yes'"):
        _trainer().fit(_strategy(), 2, max_steps=1, overwrite="yes", **FIT)
    with pytest.raises(ValueError, match="overwrite=True would delete the run that resume_from continues"):
        _trainer().fit(_strategy(), 2, max_steps=1, overwrite=True, resume_from="logs/x", **FIT)
    Path("logs/mine").mkdir(parents=True)
    Path("logs/mine/notes.txt").write_text("my own file")  # not a run, but not ours to mix into either
    with pytest.raises(RunFolderError, match=r"'logs/mine' already holds files \(notes.txt\)"):
        _trainer().fit(_strategy(), 2, max_steps=1, run_name="mine", **FIT)
    Path("logs/empty").mkdir()  # an empty folder made beforehand is fine
    _trainer().fit(_strategy(), 2, max_steps=1, run_name="empty", **FIT)
    assert _steps("logs/empty/train.csv") == [1]


def test_a_resumed_run_continues_in_its_own_folder_and_its_csv_holds_the_whole_run():
    full = _trainer()
    full.fit(_strategy(), 2, max_steps=9, run_name="full", **FIT)
    _trainer().fit(_strategy(), 2, max_steps=9, run_name="r", checkpoint_interval=4, **FIT)
    # As if the run died after its step-4 checkpoint with rows up to 9 written: resume re-trains 5..9.
    _trainer().fit(_strategy(), 2, max_steps=9, resume_from="logs/r/checkpoints/step_000000004", **FIT)
    assert _steps("logs/r/train.csv") == list(range(1, 10))  # the whole run, once
    assert _steps("logs/r/val.csv") == [0, 3, 6, 9]
    with open("logs/r/train.csv") as f, open("logs/full/train.csv") as g:
        resumed, uninterrupted = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert [dict(r, wall_time_s=0) for r in resumed] == [dict(r, wall_time_s=0) for r in uninterrupted]
    assert sorted(p.name for p in Path("logs").iterdir()) == ["full", "r"]  # no new folder for the resumed run


def test_continue_after_drops_later_rows_and_a_row_cut_mid_write(tmp_path):
    run = tmp_path / "logs" / "run"
    lg = CSVLogger(tmp_path / "logs", "run")
    lg.start({"strategy": "S"})
    for step in range(1, 6):
        lg.log("train", {"step": step, "loss": 1.0 / step})
    lg.finish({"status": "failed"})
    with open(run / "train.csv", "a") as f:
        f.write("6,0.16")  # a crash mid-row
    again = CSVLogger(tmp_path / "logs", "run")
    again.continue_after(3)
    again.start({"strategy": "S"})
    again.log("train", {"step": 4, "loss": 0.5, "new_metric": 1.0})  # appended under the header it has
    again.finish({"status": "completed"})
    assert (run / "train.csv").read_text().splitlines() == ["step,loss", "1,1.0", "2,0.5", "3,0.3333333333333333",
                                                            "4,0.5"]
    assert truncate_rows_after(run / "train.csv", 1) == 1
    with pytest.raises(ValueError, match="continue_after needs the checkpoint's step, an int >= 0, got -1"):
        CSVLogger(tmp_path, "x").continue_after(-1)


def test_csv_and_tensorboard_loggers_share_one_claim():
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    _trainer().fit(_strategy(), 2, max_steps=2, logger=[CSVLogger(), TensorBoardLogger()], run_name="both", **FIT)
    assert list(Path("logs/both").glob("events.out.tfevents.*")) and Path("logs/both/train.csv").exists()
    with pytest.warns(UserWarning, match=r"logs/both held an earlier run, which is kept, moved to logs/both\."):
        _trainer().fit(_strategy(), 2, max_steps=2, logger=TensorBoardLogger(run_name="both"), **FIT)
    kept = [p for p in Path("logs").iterdir() if p.name != "both"]  # the run of both loggers moved aside as one
    assert len(kept) == 1 and list(kept[0].glob("events.out.tfevents.*")) and (kept[0] / "train.csv").exists()


def test_unwritable_checkpoint_and_log_folders_fail_before_any_node_starts():
    Path("a_file").write_text("")
    with pytest.raises(RunFolderError, match=r"checkpoint_dir 'a_file/ckpt' is not writable .*pass a folder"):
        _trainer(Untouchable()).fit(_strategy(), 2, max_steps=2, checkpoint_interval=1, checkpoint_dir="a_file/ckpt",
                                    logger=False, **FIT)
    with pytest.raises(RunFolderError, match=r"the log folder 'a_file/logs' is not writable"):
        _trainer(Untouchable()).fit(_strategy(), 2, max_steps=2, logger=CSVLogger("a_file/logs"), **FIT)
    assert check_writable("fine/ckpt", "checkpoint_dir") == Path("fine/ckpt")


_RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from exogym.runs.folder import RunFolderError, claim_run
    me, root = sys.argv[1], Path(sys.argv[2])
    Path(root.parent / f"ready-{me}").touch()
    while not (root.parent / "go").exists():
        time.sleep(0.001)
    won = []
    for i in range(40):
        try:
            claim_run([root], f"run{i}", "unused")
            won.append(f"run{i}")
        except RunFolderError:
            pass
        claim_run([root], None, "default")  # and a default name every time
    print(" ".join(won))
""")


@pytest.mark.spawns
def test_processes_racing_for_the_same_names_never_share_a_folder(tmp_path):
    root, racers = tmp_path / "logs", 3
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(i), str(root)], stdout=subprocess.PIPE, text=True)
             for i in range(racers)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(racers)) and time.monotonic() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    (tmp_path / "go").touch()
    wins = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    every = [name for w in wins for name in w]
    assert sorted(every) == sorted(f"run{i}" for i in range(40))  # each explicit name won by exactly one process
    defaults = sorted(p.name for p in root.iterdir() if p.name.startswith("default"))
    assert len(defaults) == 40 * racers  # and every default claim got a folder of its own


def test_compare_rerun_moves_the_earlier_runs_aside_unless_overwrite(capsys):
    # One rule for every call style, the command line's too: a rerun never fails and never loses a run.
    pytest.importorskip("matplotlib", reason="compare draws plots")
    args = ["compare", "--task", "synthetic", "--strategies", "ddp", "--nodes", "2", "--steps", "4",
            "--val-interval", "2", "--quiet", "--out", "cmp.png", "--prefix", "c-"]
    assert main(args) == 0
    first = Path("logs/c-ddp/train.csv").read_text()
    with pytest.warns(UserWarning, match="held an earlier run, which is kept, moved to"):
        assert main(args) == 0
    kept = [p for p in Path("logs").iterdir() if p.name.startswith("c-ddp.")]
    assert len(kept) == 1 and (kept[0] / "train.csv").read_text() == first
    assert Path("logs/c-ddp/train.csv").is_file()
    assert main(args + ["--overwrite"]) == 0
    assert [p.name for p in Path("logs").iterdir() if p.name.startswith("c-ddp.")] == [kept[0].name]
