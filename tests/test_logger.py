"""Loggers: the CSV run folder by default, config.json, live rows equal to the record, optional extras."""

import csv
import json
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.runs.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu")


def _trainer():
    return Trainer(toy.TinyMLP(), toy.make_classification(128), toy.make_classification(32, seed=1))


def _read_csv(path):
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def test_default_csv_run_folder_matches_the_record():
    t = _trainer()
    t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1), max_norm=2.0), 3, batch_size=8, max_steps=7,
          val_interval=3, log_interval=2, run_name="ddp-test", **FIT)
    run = Path("logs") / "ddp-test"
    config = json.loads((run / "config.json").read_text())
    assert config["num_nodes"] == 3 and config["global_batch"] == 24 and config["seed"] == 42
    assert config["strategy_config"]["max_norm"] == 2.0
    assert config["strategy_config"]["optim_spec"] == {"optimizer": "SGD", "lr": 0.1}
    assert config["parameters"] == sum(p.numel() for p in toy.TinyMLP().parameters())
    assert set(config["versions"]) == {"exogym", "torch", "python"}
    logged = [row for row in t.record.train if row["step"] % 2 == 0 or row["step"] == 7]  # log_interval=2, last
    original = ("examples_trained", "train_loss", "train_perplexity")  # the original EXO Gym's columns, after ours
    assert [{k: v for k, v in row.items() if k not in original} for row in _read_csv(run / "train.csv")] == \
        [{k: float(v) for k, v in row.items()} for row in logged]
    assert _read_csv(run / "val.csv") == [{k: float(v) for k, v in row.items()} for row in t.record.val]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 7
    assert summary["bytes_per_node"] == t.record.bytes_per_node


def test_logger_false_writes_nothing_and_bad_loggers_are_rejected():
    _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=2, logger=False, **FIT)
    assert not Path("logs").exists()
    with pytest.raises(TypeError, match="logger must be an exogym.runs.loggers.Logger"):
        _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=2, logger="csv", **FIT)


class Recording(Logger):
    def __init__(self):
        self.calls = []

    def start(self, config):
        self.calls.append(("start", config["num_nodes"]))

    def log(self, table, row):
        self.calls.append((table, row["step"]))

    def finish(self, summary):
        self.calls.append(("finish", summary["status"]))


def test_rows_arrive_every_log_interval_and_a_failed_run_is_finished():
    lg = Recording()
    _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=5, val_interval=4, log_interval=2,
                   logger=lg, **FIT)
    assert lg.calls[0] == ("start", 2) and lg.calls[-1] == ("finish", "completed")
    assert [c for c in lg.calls if c[0] == "train"] == [("train", 2), ("train", 4), ("train", 5)]  # every 2nd, last
    assert [c for c in lg.calls if c[0] == "val"] == [("val", 0), ("val", 4), ("val", 5)]
    lg = Recording()
    _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=3, logger=lg, **FIT)  # default: every step
    assert [c for c in lg.calls if c[0] == "train"] == [("train", 1), ("train", 2), ("train", 3)]

    class Broken(toy.TinyMLP):
        def forward(self, batch):
            raise RuntimeError("broken model")

    lg = Recording()
    with pytest.raises(RuntimeError, match="broken model"):
        Trainer(Broken(), toy.make_classification(64)).fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=2,
                                                           logger=lg, **FIT)
    assert lg.calls == [("start", 2), ("finish", "failed")]


def test_tensorboard_event_files():
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=3, logger=TensorBoardLogger("tb", "run"),
                   **FIT)
    assert list(Path("tb/run").glob("events.out.tfevents.*"))


@pytest.mark.spawns
def test_wandb_offline_run_folder():
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    lg = WandbLogger(project="exogym-test", run_name="offline", mode="offline", dir=".")
    _trainer().fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=3, logger=[CSVLogger(), lg], **FIT)
    assert list(Path("wandb").glob("offline-run-*"))
