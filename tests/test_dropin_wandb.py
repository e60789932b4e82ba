"""W&B as the original EXO Gym logged it: its metric names (with perplexities) for every run, and the offline hint
(the folder wandb writes, said once per process)."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import toy
import exogym.runs.loggers as loggers
from exogym import Trainer
from exogym.runs.loggers import WandbLogger, wandb_metrics
from exogym.strategy.strategy import SimpleReduceStrategy

pytest.importorskip("wandb", reason="the wandb extra is not installed")

ORIGINAL = {"train_loss", "train_perplexity", "lr", "local_loss", "local_perplexity", "global_loss",
            "global_perplexity"}


class FakeWandb:
    """wandb at the seam: init() returns a run recording what is logged; no API key."""

    def __init__(self, root):
        self.root, self.runs = Path(root), []

    def Api(self):
        return SimpleNamespace(api_key=None)

    def init(self, project, name, config, mode, dir, **kw):
        folder = self.root / "wandb" / f"offline-run-{len(self.runs)}"
        run = SimpleNamespace(dir=str(folder / "files"), logged=[], mode=mode, summary={},
                              define_metric=lambda *a, **k: None, finish=lambda: None)
        run.log = run.logged.append
        self.runs.append(run)
        return run


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    fake = FakeWandb(tmp_path)
    monkeypatch.setattr(loggers, "_SAID_OFFLINE", False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    original_init = WandbLogger.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._wandb = fake
    monkeypatch.setattr(WandbLogger, "__init__", init)
    return fake


def _fit(trainer, **kw):
    return trainer.fit(num_epochs=1, max_steps=4, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                       val_size=16, val_interval=2, progress=False, **kw)


def test_every_run_logs_the_originals_metric_names_with_perplexities(fake_wandb):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
    _fit(trainer, wandb_project="p", run_name="a")  # the original's spelling
    trainer.fit(SimpleReduceStrategy(), 2, max_steps=4, batch_size=8, val_size=16, val_interval=2, progress=False,
                logger=WandbLogger("p", "b"))  # this library's own
    for run in fake_wandb.runs:
        names = set().union(*run.logged)
        assert ORIGINAL <= names
        assert not any("/" in n for n in names)  # no train/loss, val/global_loss
        for data in run.logged:
            for which in ("train", "local", "global"):
                if f"{which}_loss" in data:
                    assert data[f"{which}_perplexity"] == pytest.approx(math.exp(data[f"{which}_loss"]))
        train = [d for d in run.logged if "train_loss" in d]
        assert [d["train_loss"] for d in train] == [r["loss"] for r in trainer.record.train]
        assert [d["step"] for d in train] == [1, 2, 3, 4]


def test_the_offline_hint_names_wandbs_offline_run_folders_once_per_process(fake_wandb, capsys):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
    for name in ("k1", "k2", "k3"):  # as diloco_scaling.py: one fit per K
        _fit(trainer, wandb_project="p", run_name=name)
    out = capsys.readouterr().out
    hints = [line for line in out.splitlines() if "W&B logs offline" in line]
    assert len(hints) == 1 and all(run.mode == "offline" for run in fake_wandb.runs)
    folder = fake_wandb.root / "wandb"
    assert hints[0] == ("exogym: W&B logs offline: no W&B API key is configured (wandb login); upload the runs later "
                        f"with `wandb sync {folder}/offline-run-*`")


def test_wandb_metrics_names_other_columns_by_their_table():
    assert wandb_metrics("train", {"step": 3, "examples": 48, "loss": 0.0, "lr": 0.1, "bytes": 8}) == \
        {"train_loss": 0.0, "train_perplexity": 1.0, "lr": 0.1, "train_bytes": 8}
    assert wandb_metrics("val", {"step": 2, "local_loss": 1.0, "local_accuracy": 0.5}) == \
        {"local_loss": 1.0, "local_perplexity": math.e, "local_accuracy": 0.5}
    assert wandb_metrics("diagnostics", {"step": 2, "correlation": 0.9}) == {"diagnostics_correlation": 0.9}
