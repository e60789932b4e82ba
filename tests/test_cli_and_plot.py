"""The command line end to end on the synthetic task, and plots from run folders and records."""

import struct
from pathlib import Path

import pytest

import toy
from exogym import Trainer
from exogym.cli import main
from exogym.plot import load_run, plot_runs
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
    assert "run folder: logs/one" in out and "| ddp" in out
    assert main(["compare", "--task", "synthetic", "--strategies", "ddp", "--nodes", "2", "--steps", "20",
                 "--val-interval", "10", "--quiet", "--out", "cmp.png", "--prefix", "c-"]) == 0
    width, height = _png_size(Path("cmp.png"))
    assert width > 300 and height > 200
    _png_size(Path("cmp_vs_bytes.png"))
    assert main(["plot", "logs/one", "logs/c-ddp-2n", "--x", "examples", "--y", "loss", "--out", "p.png"]) == 0
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
    assert folder.train == [{k: float(v) for k, v in r.items()} for r in t.record.train]
    out = plot_runs([t.record, "logs/rec"], x="bytes", y="global_accuracy", out="acc.png", labels=["a", "b"])
    _png_size(out)
    with pytest.raises(KeyError, match="no column 'perplexity'"):
        plot_runs([t.record], y="perplexity", out="x.png")
    with pytest.raises(ValueError, match="x must be one of"):
        plot_runs([t.record], x="epochs", out="x.png")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        plot_runs(["nowhere"], out="x.png")
