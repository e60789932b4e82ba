"""A node's batches gathered by index tensors are DistributedSampler's, bit for bit: sampler_order against the
sampler's own lists (padding, cutting, unshuffled), and NodeBatches' batches against the lists' gathers."""

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from exogym.data.sharding import NodeBatches, _collate, sampler_order


@pytest.mark.parametrize("n, replicas", [(400, 4), (13, 4), (10, 16), (7, 1)])  # 10 < 16: padded past one repeat
@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (False, False), (True, True)])
def test_sampler_order_is_the_samplers_list(n, replicas, shuffle, drop_last):
    data = list(range(n))
    for rank, epoch in itertools.product(range(replicas), range(3)):
        sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        assert sampler_order(sampler, epoch).tolist() == list(sampler)


def test_node_batches_are_the_index_lists_gathers():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(203, 3, generator=g), torch.randint(0, 5, (203,), generator=g))
    batches = NodeBatches(data, rank=2, num_nodes=3, batch_size=8, shuffle=True, seed=1, shard=True)
    got, lists = batches.iterate(from_step=5), batches.index_batches(5)
    for _ in range(3 * batches.steps_per_epoch):  # across epochs, from mid-epoch
        x, y = next(got)
        want_x, want_y = _collate(data, next(lists))
        assert torch.equal(x, want_x) and torch.equal(y, want_y)


def test_a_gather_is_indexings_rows():
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(50, 2, 3, generator=g), torch.randint(0, 5, (50,), generator=g)
    rows = [7, 3, 3, 49, 0]
    x, y = _collate(TensorDataset(xs, ys), rows)
    assert torch.equal(x, xs[rows]) and torch.equal(y, ys[rows])
