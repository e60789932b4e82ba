"""The original EXO Gym repository's scripts as a user runs them here: each script's fit calls (on a tiny model),
then what the script reads back (mnist.py's validation.csv and its final-loss ranking), and the same command run
twice (the earlier run is moved aside, never lost; this library's own spelling keeps refusing)."""

import csv
import json
import math
import os
import socket
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

import toy
import exogym
from exogym.runs.folder import MARKER, RunFolderError
from exogym.runs.loggers import CSVLogger
from exogym.strategy.optim import OptimSpec
from exogym.strategy.strategy import SimpleReduceStrategy
from exogym.trainer import Trainer

VALIDATION_COLUMNS = ["step", "local_loss", "local_perplexity", "global_loss", "global_perplexity"]
SCHEDULE = dict(lr_scheduler="lambda_cosine", lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True})


def _trainer(**kw):
    return Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1), **kw)


def _mnist_reads_back(run_name):
    """What example/mnist.py does with a run folder: logs/<run>/validation.csv through csv.DictReader, the global
    loss where there is one (else the local), and the last one as the run's final loss."""
    with open(os.path.join("logs", run_name, "validation.csv")) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    steps, losses = [], []
    for row in rows:
        key = "global_loss" if row.get("global_loss", "").strip() else "local_loss"
        steps.append(int(row["step"]))
        losses.append(float(row[key]))
    return reader.fieldnames, steps, losses


def test_mnist_sweep_writes_what_its_plot_reads_and_ranks_the_final_losses():
    from exogym.strategy.diloco import DiLoCoStrategy
    from exogym.strategy.sparta import SPARTAStrategy

    optim_spec = OptimSpec(torch.optim.AdamW, lr=3e-3, weight_decay=1e-4)
    final = {}
    for name, Strat in [("ddp", SimpleReduceStrategy), ("diloco", DiLoCoStrategy), ("sparta", SPARTAStrategy)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # H= / p= where the strategy has none: said, and tested elsewhere
            strategy = Strat(optim_spec=optim_spec, H=2, p=0.05, **SCHEDULE)
        trainer = _trainer()
        trainer.fit(max_steps=4, num_epochs=5, strategy=strategy, num_nodes=4, device="cpu", batch_size=8,
                    val_size=32, val_interval=2, wandb_project=None, run_name=f"mnist_{name}_20250101_000000",
                    progress=False)
        header, steps, losses = _mnist_reads_back(f"mnist_{name}_20250101_000000")
        assert header == VALIDATION_COLUMNS and steps == [0, 2, 4]
        assert losses == [row["global_loss"] for row in trainer.record.val]
        final[name] = losses[-1]
        with open(f"logs/mnist_{name}_20250101_000000/validation.csv") as f:
            row = next(csv.DictReader(f))
        assert float(row["global_perplexity"]) == pytest.approx(torch.tensor(float(row["global_loss"])).exp().item())
        config = json.loads(Path(f"logs/mnist_{name}_20250101_000000/config.json").read_text())
        ignored = config["ignored"]
        assert ignored["num_epochs"]["value"] == 5 and "num_epochs" not in config  # max_steps set the length
        assert ("strategy.H" in ignored) == (name != "diloco") and "strategy.p" in ignored
        assert "H" not in config["strategy_config"] or name == "diloco"
    ranking = sorted(final.items(), key=lambda kv: kv[1])  # the script's "FINAL VALIDATION LOSS SUMMARY"
    assert [loss for _, loss in ranking] == sorted(final.values()) and len(ranking) == 3


@pytest.mark.parametrize("style", ["original", "keywords", "own"])
def test_train_csv_of_every_run_has_the_originals_columns_too(style):
    """One rule for every call style: the original's positional order, llms.txt's keyword call (no original-only
    keyword), and this library's own fit(strategy, num_nodes)."""
    trainer = _trainer()
    calls = {"original": lambda: trainer.fit(1, SimpleReduceStrategy(), 2, 3, batch_size=8, run_name="r",
                                             progress=False),
             "keywords": lambda: trainer.fit(num_epochs=1, max_steps=3, strategy=SimpleReduceStrategy(), num_nodes=2,
                                             batch_size=8, run_name="r", progress=False),
             "own": lambda: trainer.fit(SimpleReduceStrategy(), 2, max_steps=3, batch_size=8, run_name="r",
                                        progress=False)}
    calls[style]()
    with open("logs/r/train.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"step", "examples_trained", "train_loss", "train_perplexity", "lr"} <= set(rows[0])
    assert len(rows) == 3
    for row, rec in zip(rows, trainer.record.train):
        assert float(row["train_loss"]) == float(row["loss"]) == rec["loss"]
        assert float(row["train_perplexity"]) == pytest.approx(math.exp(rec["loss"]))
        assert int(float(row["examples_trained"])) == rec["examples"] == rec["step"] * 16
    assert Path("logs/r/validation.csv").exists()  # every run folder has the original's validation file


def _nanogpt_fit(trainer, run_name, **kw):
    """nanogpt_train.py's fit call with the script's defaults (save_dir="./checkpoints", log_x_axis="step")."""
    strategy = kw.pop("strategy", None) or SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3),
                                                                max_norm=1.0, **SCHEDULE)
    return trainer.fit(num_epochs=1, max_steps=3, strategy=strategy, num_nodes=2, device="",
        batch_size=8, minibatch_size=None, shuffle=True, val_size=16, val_interval=2, correlation_interval=None,
        save_dir=kw.pop("save_dir", "./checkpoints"), wandb_project=None, run_name=run_name,
        log_x_axis=kw.pop("log_x_axis", "step"), progress=False, **kw)


def test_the_same_command_twice_keeps_the_earlier_run_and_writes_where_the_script_reads():
    _nanogpt_fit(_trainer(start_port=15000), "ddp_bs8_lr1e-03_n2")
    first = Path("logs/ddp_bs8_lr1e-03_n2/train.csv").read_text()
    started = json.loads(Path("logs/ddp_bs8_lr1e-03_n2", MARKER).read_text())["started"]
    with pytest.warns(UserWarning, match=r"logs/ddp_bs8_lr1e-03_n2 held an earlier run, which is kept, moved to "
                                         r"logs/ddp_bs8_lr1e-03_n2\.\d{8}-\d{6}; this run writes to "
                                         r"logs/ddp_bs8_lr1e-03_n2$") as caught:
        _nanogpt_fit(_trainer(start_port=15000), "ddp_bs8_lr1e-03_n2")
    assert caught[0].filename == __file__  # the warning points at the script's own fit call
    stamp = started.replace("-", "").replace(":", "").replace(" ", "-")
    kept = Path(f"logs/ddp_bs8_lr1e-03_n2.{stamp}")
    assert kept.is_dir() and (kept / "train.csv").read_text() == first  # nothing lost
    assert sorted(p.name for p in Path("logs").iterdir()) == ["ddp_bs8_lr1e-03_n2", kept.name]
    assert json.loads(Path("logs/ddp_bs8_lr1e-03_n2/summary.json").read_text())["status"] == "completed"
    with pytest.warns(UserWarning, match=r"moved to logs/ddp_bs8_lr1e-03_n2\.\d{8}-\d{6}(-2)?;"):
        _nanogpt_fit(_trainer(), "ddp_bs8_lr1e-03_n2")  # a third time: each earlier run keeps its own name
    assert len(list(Path("logs").iterdir())) == 3
    assert not Path("checkpoints").exists()  # save_dir without checkpoint_interval: nothing written


@pytest.mark.parametrize("style", ["keywords", "own", "logger"])
def test_every_call_style_reruns_a_name_the_same_way(style):
    """llms.txt's keyword call, this library's own spelling and a logger's run_name: a rerun moves the earlier run
    aside, as the original's spelling does (one rule); overwrite=True still replaces, a running run still refuses
    with the public error."""
    def fit(**kw):
        t = _trainer()
        if style == "keywords":
            return t.fit(num_epochs=1, max_steps=2, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                         run_name="exp", progress=False, **kw)
        if style == "own":
            return t.fit(SimpleReduceStrategy(), 2, max_steps=2, batch_size=8, run_name="exp", progress=False, **kw)
        return t.fit(SimpleReduceStrategy(), 2, max_steps=2, batch_size=8, logger=CSVLogger(run_name="exp"),
                     progress=False, **kw)

    fit()
    first = Path("logs/exp/train.csv").read_text()
    with pytest.warns(UserWarning, match=r"logs/exp held an earlier run, which is kept, moved to "
                                         r"logs/exp\.\d{8}-\d{6}; this run writes to logs/exp$") as caught:
        fit()
    assert caught[0].filename == __file__
    kept = [p for p in Path("logs").iterdir() if p.name != "exp"]
    assert len(kept) == 1 and (kept[0] / "train.csv").read_text() == first
    assert json.loads(Path("logs/exp/summary.json").read_text())["status"] == "completed"
    fit(overwrite=True)  # replaces, as asked: nothing more is kept
    assert len(list(Path("logs").iterdir())) == 2
    marker = Path("logs/exp", MARKER)
    marker.write_text(marker.read_text().replace('"completed"', '"running"'))  # as if it were running (this pid)
    with pytest.raises(RunFolderError, match=r"'logs/exp' already holds a run \(running") as caught:
        fit()
    assert type(caught.value) is exogym.RunFolderError  # the documented class itself, not a private subclass
    assert len(list(Path("logs").iterdir())) == 2


def test_save_dir_with_checkpoint_interval_moves_the_earlier_checkpoints_aside_with_their_run():
    _nanogpt_fit(_trainer(), "ck", checkpoint_interval=2)
    assert sorted(p.name for p in Path("checkpoints/ck").iterdir()) == ["step_000000002", "step_000000003"]
    with pytest.warns(UserWarning, match=r"logs/ck, checkpoints/ck held an earlier run, which is kept, moved to "
                                         r"logs/ck\.(\d{8}-\d{6}), checkpoints/ck\.\1;"):
        _nanogpt_fit(_trainer(), "ck", checkpoint_interval=2)
    kept = [p for p in Path("checkpoints").iterdir() if p.name != "ck"]
    assert len(kept) == 1 and (kept[0] / "step_000000003" / "manifest.json").exists()
    assert (Path("checkpoints/ck") / "step_000000003" / "manifest.json").exists()


def test_names_made_for_save_dir_in_the_same_second_never_collide(monkeypatch):
    monkeypatch.setattr("exogym.runs.loggers.time.strftime", lambda fmt, *a: "20260101-000000")
    for _ in range(3):
        _trainer().fit(num_epochs=1, max_steps=2, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                       save_dir="ckpt", checkpoint_interval=2, progress=False)
    names = sorted(p.name for p in Path("ckpt").iterdir())
    assert names == ["SimpleReduceStrategy-2n-20260101-000000", "SimpleReduceStrategy-2n-20260101-000000-2",
                     "SimpleReduceStrategy-2n-20260101-000000-3"]
    assert sorted(p.name for p in Path("logs").iterdir()) == names  # the run folder has the same name


def test_a_run_still_running_in_the_folder_is_not_moved():
    Path("logs/busy").mkdir(parents=True)
    Path("logs/busy", MARKER).write_text(json.dumps({"run_id": "x", "status": "running", "pid": os.getpid(),
                                                     "host": socket.gethostname(), "time": "2026-01-01 00:00:00"}))
    with pytest.raises(RunFolderError, match="already holds a run"):
        _nanogpt_fit(_trainer(), "busy")
    assert sorted(p.name for p in Path("logs").iterdir()) == ["busy"]


def test_log_x_axis_without_wandb_is_accepted_with_one_warning():
    with pytest.warns(UserWarning, match=r"^log_x_axis='examples' has no effect: it sets the x-axis of W&B charts "
                                         r"only") as caught:
        _nanogpt_fit(_trainer(), "xaxis", log_x_axis="examples")
    assert len([w for w in caught if "log_x_axis" in str(w.message)]) == 1 and "\n" not in str(caught[0].message)
    ignored = json.loads(Path("logs/xaxis/config.json").read_text())["ignored"]
    assert ignored["log_x_axis"]["value"] == "examples" and ignored["save_dir"]["value"] == "./checkpoints"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the scripts' default "step" changes nothing and says nothing
        _nanogpt_fit(_trainer(), "xaxis-step", log_x_axis="step")
    with pytest.raises(ValueError, match="log_x_axis must be 'step' or 'examples', got 'epochs'"):
        _nanogpt_fit(_trainer(), "xaxis-bad", log_x_axis="epochs")


def test_diloco_scaling_run_twice_with_wandb(monkeypatch):
    pytest.importorskip("wandb")
    from exogym.runs.loggers import WandbLogger
    from exogym.strategy.diloco import DiLoCoStrategy

    started = []
    monkeypatch.setattr(WandbLogger, "start", lambda self, config: started.append((self.run_name, self.x_axis)))
    monkeypatch.setattr(WandbLogger, "log", lambda self, table, row: None)
    monkeypatch.setattr(WandbLogger, "finish", lambda self, summary: None)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(start_port=12355).fit(
                num_epochs=1, max_steps=2, strategy=DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3),
                                                                   max_norm=1.0, H=2, **SCHEDULE),
                num_nodes=2, device="cpu", batch_size=8, shuffle=True, val_size=16, val_interval=2,
                wandb_project="DiLoCo-Scaling", run_name="diloco-K2-batchsize16", log_x_axis="examples",
                kwargs={"dataset_name": "shakespeare"}, progress=False)
    assert started == [("diloco-K2-batchsize16", "examples")] * 2
    assert len([p for p in Path("logs").iterdir() if p.name.startswith("diloco-K2-batchsize16.")]) == 1
    started.clear()
    _trainer().fit(num_epochs=1, max_steps=1, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                   wandb_project="p", progress=False)  # no run_name: W&B takes the run folder's name
    assert started[0][0] == next(p.name for p in Path("logs").iterdir() if p.name.startswith("SimpleReduce"))


def test_a_run_failing_before_its_first_step_leaves_no_folder():
    class Broken(SimpleReduceStrategy):
        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            raise RuntimeError("broken before the first step")

    with pytest.raises(RuntimeError, match="broken before the first step"):
        _nanogpt_fit(_trainer(), "broken", checkpoint_interval=1, strategy=Broken())
    with pytest.raises(ValueError, match="val_size must be"):  # refused before any node starts
        _trainer().fit(num_epochs=1, strategy=SimpleReduceStrategy(), num_nodes=2, val_size=0, save_dir="ckpt",
                       checkpoint_interval=1, run_name="refused", progress=False)
    with pytest.raises(RuntimeError, match="broken before the first step"):
        _trainer().fit(Broken(), 2, max_steps=2, batch_size=8, checkpoint_interval=1, progress=False)
    assert not Path("logs").exists() and not Path("checkpoints").exists() and not Path("ckpt").exists()


def test_image_train_factory_run_twice():
    def image_factory(subset, seed, batch_size, rank, num_nodes, train_dataset):
        return toy.make_classification(64 if train_dataset else 16, seed=rank if train_dataset else 9)

    factory = partial(image_factory, 1.0, 0, 8)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(toy.TinyMLP(), factory, factory).fit(
                num_epochs=1, max_steps=2, strategy=SimpleReduceStrategy(), num_nodes=2, device="", batch_size=8,
                minibatch_size=8, shuffle=True, val_size=16, val_interval=2, correlation_interval=None,
                save_dir="./checkpoints", wandb_project=None, run_name="image_ddp_bs8", progress=False,
                dataloader_kwargs={"num_workers": 0})
    assert len(list(Path("logs").iterdir())) == 2 and not Path("checkpoints").exists()
