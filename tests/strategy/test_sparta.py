"""SPARTA: shared-seed indices, bytes of just the selected values, late averages applied as corrections."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import CommunicateOptimizeStrategy, OptimSpec, SPARTAStrategy
from exogym.strategy.sparta import SparseCommunicator
from strategy_toys import FIT, NODES, node_params, run_linear, watched

SIZES = [16 * 8, 16, 3 * 16, 3]  # TinyMLP's parameters
SELECTED: dict = {}


class RecordingSparse(SparseCommunicator):
    """Records the indices each node selects at each step (a fake at the seam, behaviour unchanged)."""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.rank = rank

    def select(self, local_step, sizes):
        out = super().select(local_step, sizes)
        SELECTED[(self.rank, local_step)] = [i.clone() for i in out]
        return out


def fit(strategy, nodes=3, steps=20):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256))
    trainer.fit(strategy, nodes, batch_size=8, max_steps=steps, **FIT)
    return trainer


def test_every_node_selects_the_same_indices_and_they_change_every_step():
    for mode in ("random", "sequential", "shuffled_sequential", "partitioned"):
        SELECTED.clear()
        fit(CommunicateOptimizeStrategy([RecordingSparse(0.1, sparsification_mode=mode)], "adamw"), steps=6)
        for step in range(1, 7):
            for r in (1, 2):
                assert all(torch.equal(a, b) for a, b in zip(SELECTED[(0, step)], SELECTED[(r, step)]))
        assert not torch.equal(SELECTED[(0, 1)][0], SELECTED[(0, 2)][0])


def test_partitioned_mode_averages_every_entry_once_per_cycle():
    m = SparseCommunicator(0.25, sparsification_mode="partitioned")
    for cycle in range(2):
        chosen = [m.select(cycle * 4 + s, [10])[0] for s in range(1, 5)]
        assert sorted(torch.cat(chosen).tolist()) == list(range(10))


@pytest.mark.parametrize("p, parts", [(0.4, 3), (0.25, 4), (0.3, 4), (0.005, 200)])
def test_partitioned_mode_uses_ceil_one_over_p_parts(p, parts):
    # The original EXO Gym's PartitionedIndexSelector: min(ceil(1/p), n) parts; at p=0.4 a third of the entries
    # per step, not a half. Over one cycle every entry once, in parts of n // P or n // P + 1.
    m = SparseCommunicator(p, sparsification_mode="partitioned")
    n = 1000
    chosen = [m.select(s, [n])[0] for s in range(1, parts + 1)]
    assert sorted(torch.cat(chosen).tolist()) == list(range(n))
    assert {len(c) for c in chosen} <= {n // parts, -(-n // parts)}
    assert m.select(1, [3])[0].numel() == 1 and len({m.select(s, [3])[0].item() for s in (1, 2, 3)}) == 3


def test_shuffled_sequential_walks_one_fixed_permutation_in_ceil_one_over_p_windows():
    m = SparseCommunicator(0.3, sparsification_mode="shuffled_sequential", seed=7)
    n, parts = 10, 4  # windows of 3, 3, 2, 2 (the first n mod P one longer), as the original's selector
    cycle = [m.select(s, [n, 5])[0] for s in range(1, parts + 1)]
    assert [len(c) for c in cycle] == [3, 3, 2, 2]
    order = torch.cat(cycle)
    assert sorted(order.tolist()) == list(range(n)) and order.tolist() != list(range(n))  # shuffled, each once
    again = [m.select(s, [n, 5])[0] for s in range(parts + 1, 2 * parts + 1)]
    assert all(torch.equal(a, b) for a, b in zip(cycle, again))  # the same permutation every cycle
    assert [len(m.select(s, [n, 5])[1]) for s in range(1, 5)] == [2, 1, 1, 1]  # 5 entries in 4 windows
    other = SparseCommunicator(0.3, sparsification_mode="shuffled_sequential", seed=7)
    assert torch.equal(other.select(3, [n, 5])[0], cycle[2])  # a fresh node (or a resumed run) agrees


def test_partitioned_bytes_follow_the_true_fraction():
    # p = 0.4: 3 parts, so 3 steps send every entry once: on 2 nodes the ring all-reduce sends N per node.
    t = fit(SPARTAStrategy("adamw", p_sparta=0.4, sparsification_mode="partitioned"), nodes=2, steps=3)
    assert t.record.bytes_per_node == [4 * sum(SIZES)] * 2


def test_bytes_per_step_are_p_times_the_model_values_only():
    # sequential: exactly round(p n) entries of each parameter (at least 1)
    t = fit(SPARTAStrategy("adamw", p_sparta=0.25, sparsification_mode="sequential"), nodes=2, steps=5)
    values = sum(max(1, round(0.25 * n)) for n in SIZES)
    assert t.record.bytes_per_node == [5 * all_reduce_bytes(4 * values, 2)] * 2
    # random: p n entries on average
    steps, p = 200, 0.05
    t = fit(SPARTAStrategy("adamw", p_sparta=p, lr=1e-3), nodes=2, steps=steps)
    model_bytes = 4 * sum(SIZES)
    per_step = t.record.bytes_per_node[0] / steps
    assert abs(per_step / all_reduce_bytes(model_bytes, 2) - p) < 0.2 * p
    assert t.record.comm_per_node[0]["calls_by_op"] == {"all_reduce": steps}


def test_async_delay_applies_each_average_late_as_a_correction():
    # Two nodes, constant gradients c_r, SGD eta, every entry averaged (p=1), one step late. Each step the
    # correction that arrives is eta (mean c - c_r), so after n steps node r holds
    # theta_0 - eta (n-1) mean(c) - eta c_r (the last average is still on its way).
    grads, init, eta, n = [[1.0, -2.0], [3.0, 4.0]], [0.5, 0.5], 0.1, 4
    run_linear(watched(SPARTAStrategy)(OptimSpec(torch.optim.SGD, lr=eta), p_sparta=1.0, async_delay=1), grads,
               init, n)
    c = torch.tensor(grads)
    for r in range(2):
        assert_close(node_params(r), torch.tensor(init) - eta * (n - 1) * c.mean(0) - eta * c[r])
    assert len(NODES[0][1].modules[0].pending) == 1
