"""Non-IID data: Dirichlet label partitions cover every example once and skew with small alpha."""

import numpy as np
import pytest
import torch

import toy
from exogym import Trainer
from exogym.data.partition import dirichlet_partition
from exogym.strategy import SimpleReduceStrategy


def _labelled(n=3000, classes=10):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g), torch.arange(n) % classes)


def _skew(hists):
    """Mean share of a node's examples that belong to its most common class."""
    return float(np.mean([max(h) / sum(h) for h in hists]))


def test_every_example_lands_on_exactly_one_node_and_small_alpha_skews():
    ds = _labelled()
    skewed = dirichlet_partition(ds, 8, 0.1, seed=0)
    near_iid = dirichlet_partition(ds, 8, 1000.0, seed=0)
    for part in (skewed, near_iid):
        flat = sorted(i for idx in part.indices for i in idx)
        assert flat == list(range(len(ds)))
        assert [sum(h) for h in part.label_histograms()] == part.sizes
    assert _skew(skewed.label_histograms()) > 0.5
    assert _skew(near_iid.label_histograms()) < 0.2  # ~0.1 for 10 balanced classes
    assert dirichlet_partition(ds, 8, 0.1, seed=0).indices == skewed.indices  # seeded
    assert dirichlet_partition(ds, 8, 0.1, seed=1).indices != skewed.indices


def test_fit_trains_on_the_partition_and_records_it():
    ds = _labelled(800, classes=3)
    t = Trainer(toy.TinyMLP(), ds)
    t.fit(SimpleReduceStrategy(), 4, batch_size=8, max_steps=3, partition="dirichlet", dirichlet_alpha=0.3,
          progress=False, device="cpu", logger=False)
    part = t.record.config["partition"]
    assert sum(part["sizes"]) == 800 and len(part["label_histograms"]) == 4
    assert t.record.config["steps_per_epoch"] == min(part["sizes"]) // 8


def test_partition_arguments_are_checked():
    t = Trainer(toy.TinyMLP(), _labelled(64, classes=3))
    kw = dict(progress=False, device="cpu", logger=False, max_steps=1)
    with pytest.raises(ValueError, match="partition must be 'iid' or 'dirichlet'"):
        t.fit(SimpleReduceStrategy(), 2, partition="label", **kw)
    with pytest.raises(TypeError, match="dirichlet_alpha must be a number"):
        t.fit(SimpleReduceStrategy(), 2, partition="dirichlet", **kw)
    with pytest.raises(TypeError, match="only applies to partition='dirichlet'"):
        t.fit(SimpleReduceStrategy(), 2, dirichlet_alpha=0.5, **kw)
    with pytest.raises(ValueError, match="could not split 64 examples into 8"):
        t.fit(SimpleReduceStrategy(), 8, batch_size=8, partition="dirichlet", dirichlet_alpha=0.01, **kw)
