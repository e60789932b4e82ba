"""Non-IID data: Dirichlet label partitions cover every example once and skew with small alpha; the FedAvg
paper's shards give each node shards_per_node label-contiguous shards."""

import numpy as np
import pytest
import torch

import toy
from exogym import Trainer
from exogym.data.partition import dirichlet_partition, shards_partition
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
    with pytest.raises(ValueError, match="partition must be 'iid', 'dirichlet' or 'shards', got 'label'"):
        t.fit(SimpleReduceStrategy(), 2, partition="label", **kw)
    with pytest.raises(TypeError, match="dirichlet_alpha must be a number"):
        t.fit(SimpleReduceStrategy(), 2, partition="dirichlet", **kw)
    with pytest.raises(TypeError, match="only applies to partition='dirichlet'"):
        t.fit(SimpleReduceStrategy(), 2, dirichlet_alpha=0.5, **kw)
    with pytest.raises(ValueError, match="could not split 64 examples into 8"):
        t.fit(SimpleReduceStrategy(), 8, batch_size=8, partition="dirichlet", dirichlet_alpha=0.01, **kw)


# Examples per digit in MNIST's 60,000 training images: the class boundaries fall inside shards of 300.
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def _mnist_like_labels():
    """MNIST's training labels in a shuffled order (the inputs are the example indices, to trace them)."""
    labels = torch.repeat_interleave(torch.arange(10), torch.tensor(MNIST_TRAIN_COUNTS))
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))]
    return torch.utils.data.TensorDataset(torch.arange(len(labels)), labels)


def test_shards_deal_each_node_label_contiguous_shards_and_use_every_example_once():
    ds = _mnist_like_labels()
    part = shards_partition(ds, 100, 2, seed=0)
    assert part.sizes == [600] * 100 and part.settings == {"shards_per_node": 2, "shard_size": 300}
    assert sorted(i for idx in part.indices for i in idx) == list(range(60000))
    # The shards: the examples in stable label order, cut every 300; each node holds exactly two whole ones.
    by_label = np.argsort(ds.tensors[1].numpy(), kind="stable")
    shard_of = np.empty(60000, dtype=int)
    shard_of[by_label] = np.arange(60000) // 300
    for idx in part.indices:
        ids, counts = np.unique(shard_of[idx], return_counts=True)
        assert len(ids) == 2 and counts.tolist() == [300, 300]
    # The paper: "most clients will only have examples of two digits" (a shard across a class boundary adds one).
    labels_per_node = [sum(c > 0 for c in h) for h in part.label_histograms()]
    assert sum(n <= 2 for n in labels_per_node) >= 80 and max(labels_per_node) <= 4
    assert shards_partition(ds, 100, 2, seed=0).indices == part.indices  # seeded
    assert shards_partition(ds, 100, 2, seed=1).indices != part.indices


def test_fit_records_the_shards_partition():
    ds = _labelled(800, classes=4)
    t = Trainer(toy.TinyMLP(classes=4), ds)
    t.fit(SimpleReduceStrategy(), 4, batch_size=8, max_steps=2, partition="shards", progress=False, device="cpu",
          logger=False)
    part = t.record.config["partition"]
    assert part["kind"] == "shards" and part["shards_per_node"] == 2 and part["shard_size"] == 100
    assert part["sizes"] == [200] * 4
    assert all(sum(c > 0 for c in h) <= 2 for h in part["label_histograms"])  # shards of 100 never straddle here


def test_shards_arguments_are_checked():
    t = Trainer(toy.TinyMLP(), _labelled(60, classes=3))
    kw = dict(progress=False, device="cpu", logger=False, max_steps=1, batch_size=2)
    with pytest.raises(ValueError, match=r"num_nodes x shards_per_node = 7 x 2 = 14 equal shards, so 14 must divide "
                                         r"60; change num_nodes, or use partition='dirichlet'"):
        t.fit(SimpleReduceStrategy(), 7, partition="shards", **kw)
    with pytest.raises(ValueError, match=r"4 x 2 = 8 equal shards, so 8 must divide 60; use shards_per_node in "
                                         r"\[1, 3, 5\]"):
        t.fit(SimpleReduceStrategy(), 4, partition="shards", **kw)
    with pytest.raises(ValueError, match="shards_per_node must be >= 1, got 0"):
        t.fit(SimpleReduceStrategy(), 2, partition="shards", shards_per_node=0, **kw)
    with pytest.raises(TypeError, match="shards_per_node only applies to partition='shards', got partition='iid'"):
        t.fit(SimpleReduceStrategy(), 2, shards_per_node=2, **kw)
    with pytest.raises(TypeError, match="shards_per_node only applies to partition='shards', got partition='dir"):
        t.fit(SimpleReduceStrategy(), 2, partition="dirichlet", dirichlet_alpha=1.0, shards_per_node=2, **kw)
    with pytest.raises(TypeError, match="dirichlet_alpha only applies to partition='dirichlet', got partition='sha"):
        t.fit(SimpleReduceStrategy(), 2, partition="shards", dirichlet_alpha=1.0, **kw)
    with pytest.raises(TypeError, match="partition='shards' splits one train_dataset"):
        Trainer(toy.TinyMLP(), lambda rank, n, is_val: _labelled(60)).fit(SimpleReduceStrategy(), 2,
                                                                          partition="shards", **kw)
    # The boundary: 3 nodes x 5 shards of 4 examples divide 60, one node per 3 x 2 batch; it trains.
    t.fit(SimpleReduceStrategy(), 3, partition="shards", shards_per_node=5, **kw)
    assert t.record.config["partition"]["sizes"] == [20] * 3
