"""DiLoCo's data-size weighting: with unequal shards, node i's pseudo-gradient counts n_i / sum(n)."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy, OptimSpec

DATA = [toy.make_classification(32, seed=1), toy.make_classification(96, seed=2)]
FIT = dict(batch_size=16, max_steps=2, shuffle=False, progress=False, device="cpu", logger=False)


def _factory(rank, num_nodes, is_val):
    return DATA[rank]


def test_weighted_outer_average_is_the_shard_size_weighted_mean():
    Trainer(toy.TinyMLP(), _factory).fit(toy.LocalOnly(lr=0.1, tag="w"), 2, **FIT)
    local = [toy.params(toy.REGISTRY[("w", r)]) for r in range(2)]
    plain_outer = OptimSpec(torch.optim.SGD, lr=1.0)  # global <- global - mean(delta) = the (weighted) mean
    for weighted, (w0, w1) in ((True, (32, 96)), (False, (1, 1))):
        strategy = DiLoCoStrategy("sgd", plain_outer, lr=0.1, H=2, weight_by_shard_size=weighted)
        model = Trainer(toy.TinyMLP(), _factory).fit(strategy, 2, **FIT)
        expected = [(w0 * a + w1 * b) / (w0 + w1) for a, b in zip(*local)]
        assert_close(toy.params(model), expected, rtol=1e-5, atol=1e-6)


def test_weight_by_shard_size_must_be_a_bool():
    with pytest.raises(TypeError, match="weight_by_shard_size must be True or False"):
        DiLoCoStrategy(weight_by_shard_size="yes")
