"""SPARTA's index selectors (the original EXO Gym's extension point): their import path, a communicator taking one,
every node picking the same entries from the shared seed with no mask sent, and the bytes of the values alone."""

import random

import numpy as np
import pytest
import torch

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import CommunicateOptimizeStrategy
from exogym.strategy.sparta import (IndexSelector, PartitionedIndexSelector, RandomIndexSelector,
                                    ShuffledSequentialIndexSelector, SparseCommunicator)
from strategy_toys import FIT

PICKED: list = []  # (iteration, parameter shape, mask) per call, of every node (the selector is copied per node)


class EveryOther(IndexSelector):
    """A selector of one's own: a random half of the entries every other averaging, nothing in between; it draws
    from torch, numpy and Python's streams, as a user's selector may, and records what it picked."""

    def get_indices(self, param, iteration):
        if iteration % 2:
            mask = torch.zeros_like(param, dtype=torch.bool)
        else:
            mask = torch.rand(param.shape) < 0.5
            mask.view(-1)[np.random.randint(param.numel())] = random.random() < 2  # numpy and Python too
        PICKED.append((iteration, tuple(param.shape), mask.clone()))
        return mask


def fit(module, nodes=3, steps=6):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256))
    model = trainer.fit(CommunicateOptimizeStrategy([module], "adamw"), nodes, batch_size=8, max_steps=steps, **FIT)
    return trainer, model


def test_a_selector_of_ones_own_picks_the_same_entries_on_every_node_and_only_values_are_sent():
    PICKED.clear()
    nodes, steps = 3, 6
    trainer, _ = fit(SparseCommunicator(EveryOther(0.5)), nodes, steps)
    by_call: dict = {}
    for iteration, shape, mask in PICKED:
        by_call.setdefault((iteration, shape), []).append(mask)
    assert sorted({it for it, _ in by_call}) == list(range(steps))
    for masks in by_call.values():
        assert len(masks) == nodes and all(torch.equal(masks[0], m) for m in masks)  # one shared pick, no broadcast
    halves = [by_call[(it, s)][0] for it, s in by_call if it % 2 == 0]
    assert not all(torch.equal(halves[0], h) for h in halves[1:])  # it changes with the iteration
    sent_per_iteration = {}
    for (it, _), masks in by_call.items():
        sent_per_iteration[it] = sent_per_iteration.get(it, 0) + int(masks[0].sum())
    expected = sum(all_reduce_bytes(4 * k, nodes) for k in sent_per_iteration.values() if k)
    assert trainer.record.bytes_per_node == [expected] * nodes  # the selected float32 values, nothing else


@pytest.mark.parametrize("selector, mode", [(ShuffledSequentialIndexSelector(0.3), "shuffled_sequential"),
                                            (PartitionedIndexSelector(0.3), "partitioned")])
def test_the_originals_selectors_are_the_modes_of_the_same_name_exactly(selector, mode):
    a, model_a = fit(SparseCommunicator(selector))
    b, model_b = fit(SparseCommunicator(0.3, sparsification_mode=mode))
    assert all(torch.equal(x, y) for x, y in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    assert a.record.bytes_per_node == b.record.bytes_per_node
    # On its own it gives the communicator's seed-0 entries.
    n, param = 10, torch.zeros(10)
    alone = [selector.get_indices(param, t).nonzero().squeeze(1) for t in range(4)]
    module = SparseCommunicator(0.3, sparsification_mode=mode)
    assert all(torch.equal(x.sort().values, module.select(t + 1, [n])[0].sort().values) for t, x in enumerate(alone))
    assert sorted(torch.cat(alone).tolist()) == list(range(n))  # one cycle: every entry once


def test_random_index_selector_through_the_communicator_is_shared_and_about_p():
    PICKED.clear()

    class Recording(RandomIndexSelector):
        def get_indices(self, param, iteration):
            mask = super().get_indices(param, iteration)
            PICKED.append((iteration, tuple(param.shape), mask))
            return mask

    fit(SparseCommunicator(Recording(0.25)), nodes=2, steps=40)
    by_call: dict = {}
    for iteration, shape, mask in PICKED:
        by_call.setdefault((iteration, shape), []).append(mask)
    assert all(torch.equal(*masks) for masks in by_call.values())
    fraction = sum(float(m[0].float().mean()) for m in by_call.values()) / len(by_call)
    assert abs(fraction - 0.25) < 0.05


def test_the_selector_keyword_of_the_original_and_wrong_answers():
    m = SparseCommunicator(index_selector=RandomIndexSelector(0.1))  # the original's keyword
    assert isinstance(m.selector, RandomIndexSelector)
    with pytest.raises(ValueError, match="the selector picks the entries, drop sparsification_mode"):
        SparseCommunicator(RandomIndexSelector(0.1), sparsification_mode="sequential")

    class Floats(IndexSelector):
        def get_indices(self, param, iteration):
            return torch.rand(param.shape)

    with pytest.raises(TypeError, match=r"Floats.get_indices must return a bool mask of the parameter's shape"):
        fit(SparseCommunicator(Floats(0.1)), nodes=2, steps=1)
    assert IndexSelector(0.5).get_indices(torch.zeros(2, 3), 0).all()  # the base class: every entry


def test_the_shared_streams_leave_the_nodes_own_untouched():
    from exogym.strategy.index_selectors import shared_random

    def draws():
        return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    expected = draws()
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    with shared_random(0, 5, 2):
        inside = draws()
    assert draws() == expected  # the node's streams continue as if nothing had drawn
    with shared_random(0, 5, 2):
        assert draws() == inside  # the same (seed, iteration, parameter): the same draws, on every node
    with shared_random(0, 6, 2):
        assert draws() != inside
