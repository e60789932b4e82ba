"""SPARTA's "blockwise" and "topk" modes and sparta_interval: what they select, what they send."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import OptimSpec, SPARTADiLoCoStrategy, SPARTAStrategy
from exogym.strategy.sparta import SparseCommunicator, TopKSparseCommunicator
from strategy_toys import FIT, node_params, run_linear, watched

SIZES = [16 * 8, 16, 3 * 16, 3]  # TinyMLP's parameters


def _fit(strategy, nodes=2, steps=6):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256))
    trainer.fit(strategy, nodes, batch_size=8, max_steps=steps, **FIT)
    return trainer


def test_blockwise_selects_one_contiguous_block_per_parameter_at_a_shared_random_offset():
    m = SparseCommunicator(0.25, sparsification_mode="blockwise", seed=3)
    starts = set()
    for step in range(1, 9):
        a, b = m.select(step, [10, 3])
        assert torch.equal(a, torch.arange(int(a[0]), int(a[0]) + 2))  # round(0.25 * 10) = 2 entries, in a row
        assert b.numel() == 1 and 0 <= int(b[0]) < 3 and 0 <= int(a[0]) <= 8
        starts.add(int(a[0]))
        again = SparseCommunicator(0.25, sparsification_mode="blockwise", seed=3)  # another node: the same block
        assert torch.equal(a, again.select(step, [10, 3])[0])
    assert len(starts) > 2  # the block moves


def test_blockwise_sends_only_the_block_values():
    t = _fit(SPARTAStrategy("adamw", p_sparta=0.25, sparsification_mode="blockwise"), steps=5)
    values = sum(max(1, round(0.25 * n)) for n in SIZES)
    assert t.record.bytes_per_node == [5 * all_reduce_bytes(4 * values, 2)] * 2


def test_topk_averages_each_nodes_largest_changes_and_keeps_the_rest_local():
    # Two nodes, SGD lr 1 from 0: node r's change after one step is -g_r. k = round(0.25 * 4) = 1 entry each:
    # node 0 sends index 0 (-4), node 1 index 3 (+5). Shared model: their mean [-2, 0, 0, 2.5]; each node
    # adds back what it did not send.
    run_linear(watched(SPARTAStrategy)(OptimSpec(torch.optim.SGD, lr=1.0), p_sparta=0.25, sparsification_mode="topk"),
               [[4, 1, 0, 2], [0, 3, 1, -5]], [0, 0, 0, 0], 1)
    assert node_params(0).tolist() == [-2.0, -1.0, 0.0, 0.5]
    assert node_params(1).tolist() == [-2.0, -3.0, -1.0, 2.5]


def test_topk_counts_indices_and_values_of_an_all_gather():
    t = _fit(SPARTAStrategy("adamw", p_sparta=0.25, sparsification_mode="topk"), nodes=3, steps=4)
    k = sum(max(1, round(0.25 * n)) for n in SIZES)
    assert t.record.bytes_per_node == [4 * 2 * k * (4 + 4)] * 3  # (K-1) x k x (int32 index + float32 value)
    assert isinstance(SPARTAStrategy(sparsification_mode="topk").modules[0], TopKSparseCommunicator)


def test_sparta_interval_averages_after_every_mth_step_only():
    t = _fit(SPARTAStrategy("adamw", p_sparta=0.25, sparsification_mode="sequential", sparta_interval=2), steps=6)
    values = sum(max(1, round(0.25 * n)) for n in SIZES)
    assert t.record.bytes_per_node == [3 * all_reduce_bytes(4 * values, 2)] * 2
    assert t.record.comm_per_node[0]["calls_by_op"] == {"all_reduce": 3}
    t = _fit(SPARTAStrategy("adamw", p_sparta=0.25, sparsification_mode="topk", sparta_interval=3), steps=6)
    assert t.record.comm_per_node[0]["calls_by_op"] == {"all_gather": 2}


def test_sequential_window_does_not_skip_with_an_interval():
    m = SparseCommunicator(0.25, sparsification_mode="sequential", interval=2)
    assert m.select(1, [8])[0].tolist() == [0, 1] and m.select(2, [8])[0].tolist() == [2, 3]


def test_topk_where_it_cannot_work_names_what_does():
    with pytest.raises(ValueError, match="TopKSparseCommunicator"):
        SparseCommunicator(0.1, sparsification_mode="topk")
    with pytest.raises(ValueError, match="'blockwise'"):
        SPARTADiLoCoStrategy(sparsification_mode="topk")
    with pytest.raises(ValueError, match="interval must be >= 1"):
        SparseCommunicator(0.1, interval=0)
    SPARTADiLoCoStrategy(sparsification_mode="blockwise", sparta_interval=2)
