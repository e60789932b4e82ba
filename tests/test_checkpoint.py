"""Checkpoints: resuming is bit-identical to not stopping; broken checkpoints are clear errors."""

from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.runs.checkpoint import CheckpointError
from exogym.runs.loggers import Logger
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu", logger=False)


def _trainer():
    # Dropout, shuffling across epochs (80 examples / (2 nodes x 8) = 5 steps per epoch), AdamW and a
    # cosine schedule: every piece of state a resume must restore is in play.
    return Trainer(toy.TinyMLP(dropout=0.3), toy.make_classification(80), toy.make_classification(24, seed=1))


def _strategy():
    return SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2), warmup_steps=3, cosine_anneal=True)


def _fit(t, **kwargs):
    return t.fit(_strategy(), 2, batch_size=8, max_steps=12, val_interval=5, **FIT, **kwargs)


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    full_t = _trainer()
    full = _fit(full_t)

    ckpt = tmp_path / "ckpt"
    _fit(_trainer(), checkpoint_interval=7, checkpoint_dir=ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_000000007", "step_000000012"]
    resumed_t = _trainer()
    logged = _Steps()
    resumed = resumed_t.fit(_strategy(), 2, batch_size=8, max_steps=12, val_interval=5, progress=False,
                            device="cpu", logger=logged, resume_from=ckpt / "step_000000007")
    assert logged.steps == list(range(8, 13))  # it really continued: only steps 8..12 were trained

    assert all(torch.equal(a, b) for a, b in zip(toy.params(full), toy.params(resumed)))
    assert resumed_t.record.node_loss == full_t.record.node_loss
    assert resumed_t.record.train == [dict(r, wall_time_s=r2["wall_time_s"]) for r, r2 in
                                      zip(full_t.record.train, resumed_t.record.train)]
    assert resumed_t.record.val == full_t.record.val
    assert resumed_t.record.bytes_per_node == full_t.record.bytes_per_node


class _Steps(Logger):
    def __init__(self):
        self.steps = []

    def log(self, table, row):
        if table == "train":
            self.steps.append(row["step"])


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    _fit(_trainer(), checkpoint_interval=2, checkpoint_dir=tmp_path, keep_checkpoints=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000010", "step_000000012"]


def test_a_truncated_checkpoint_is_a_clear_error_and_the_previous_one_survives(tmp_path):
    _fit(_trainer(), checkpoint_interval=4, checkpoint_dir=tmp_path)
    newest = tmp_path / "step_000000008"
    data = (newest / "node1.pt").read_bytes()
    (newest / "node1.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"node1.pt' is missing, truncated or corrupted.*earlier checkpoint"):
        _fit(_trainer(), resume_from=newest)
    assert (tmp_path / "step_000000004" / "manifest.json").exists()
    _fit(_trainer(), resume_from=tmp_path / "step_000000004")  # the earlier one still resumes


def test_resume_validation(tmp_path):
    _fit(_trainer(), checkpoint_interval=6, checkpoint_dir=tmp_path)
    (tmp_path / "step_000000099.partial").mkdir()  # what a crash mid-save leaves: never taken as complete
    with pytest.raises(CheckpointError, match=r"different run configuration(.|\n)*num_nodes: checkpoint 2, this fit 3"):
        _trainer().fit(_strategy(), 3, batch_size=8, max_steps=12, resume_from=tmp_path, **FIT)
    with pytest.raises(CheckpointError, match="at step 12, not before max_steps=12"):
        _fit(_trainer(), resume_from=tmp_path)  # the newest complete one is step 12
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        _fit(_trainer(), resume_from=tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="checkpoint_interval must be >= 1"):
        _fit(_trainer(), checkpoint_interval=0)


def test_default_checkpoint_folder_is_inside_the_run_folder():
    _trainer().fit(_strategy(), 2, batch_size=8, max_steps=4, checkpoint_interval=4, run_name="r", progress=False,
                   device="cpu")
    assert (Path("logs") / "r" / "checkpoints" / "step_000000004" / "node0.pt").exists()


def test_resume_restores_the_virtual_clocks(tmp_path):
    full_t, resumed_t = _trainer(), _trainer()
    _fit(full_t, network="low", node_speeds=[1.0, 0.5])
    _fit(_trainer(), network="low", node_speeds=[1.0, 0.5], checkpoint_interval=5, checkpoint_dir=tmp_path)
    _fit(resumed_t, network="low", node_speeds=[1.0, 0.5], resume_from=tmp_path / "step_000000005")
    assert resumed_t.record.sim_time_per_node == full_t.record.sim_time_per_node
    assert resumed_t.record.column("sim_time_s") == full_t.record.column("sim_time_s")
