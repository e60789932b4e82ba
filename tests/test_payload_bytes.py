"""Payload bytes (each node's own data put on the wire once, the papers' count) next to wire bytes (what the
ring algorithms send), per op and per strategy, in the record and the summary."""

import torch

import toy
from exogym import Trainer
from exogym.comm.transport import Group, payload_bytes
from exogym.strategy import DeMoStrategy, FedAvgStrategy, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu", logger=False, val_interval=10_000)
MODEL_BYTES = 4 * sum(p.numel() for p in toy.TinyMLP().parameters())  # 8x16 + 16 + 16x3 + 3 floats


def test_payload_per_op_counts_a_nodes_own_bytes_once():
    g4, g1 = Group((0, 1, 2, 3)), Group((2,))
    assert payload_bytes("all_reduce", 100, g4) == 100 and payload_bytes("all_gather", 100, g4) == 100
    assert payload_bytes("reduce_scatter", 100, g4) == 75  # the three quarters meant for the others
    assert [payload_bytes("broadcast", 100, g4, src=1, rank=r) for r in range(4)] == [0, 100, 0, 0]
    assert payload_bytes("all_reduce", 100, g1) == 0 and payload_bytes("barrier", 0, g4) == 0


def fit(strategy, nodes, steps):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
    trainer.fit(strategy, nodes, batch_size=8, max_steps=steps, **FIT)
    return trainer.record


def test_ddp_payload_is_the_gradients_once_per_step_and_the_wire_twice_less_a_share():
    r = fit(SimpleReduceStrategy("sgd", lr=0.1), 4, 5)
    assert r.payload_bytes_per_node == [5 * MODEL_BYTES] * 4
    assert r.wire_bytes_per_node == r.bytes_per_node == [5 * 2 * 3 * MODEL_BYTES // 4] * 4
    s = r.summary()
    assert s["payload_bytes_per_node"] == r.payload_bytes_per_node and s["wire_bytes_per_node"] == r.bytes_per_node
    assert "payload" in s["bytes_convention"] and "wire" in s["bytes_convention"]


def test_demo_payload_is_one_nodes_indices_and_values_and_the_wire_k_minus_1_copies():
    r = fit(DeMoStrategy(lr=1e-3, compression_topk=3, compression_chunk=4), 3, 4)
    per_step = (8 * 3 + 4 * 3 + 4 * 3 + 1 * 3) * 12  # chunks x top-3 x (int64 index + fp32 value), TinyMLP
    assert r.payload_bytes_per_node == [4 * per_step] * 3
    assert r.bytes_per_node == [4 * 2 * per_step] * 3  # (K-1) copies of it


def test_fedavg_hand_over_payload_counts_only_the_sender():
    # 4 nodes, 2 sampled per round, H=2: after each round the new model goes to each next-round newcomer by a
    # two-node broadcast; only its source puts bytes on the wire.
    r = fit(FedAvgStrategy("sgd", lr=0.1, H=2, client_sampling=0.5), 4, 6)
    calls = [c["calls_by_op"].get("broadcast", 0) for c in r.comm_per_node]
    averages = [c["calls_by_op"].get("all_reduce", 0) for c in r.comm_per_node]
    for rank in range(4):
        sent_broadcast = r.comm_per_node[rank]["bytes_by_op"].get("broadcast", 0)  # sources' wire = payload
        assert r.payload_bytes_per_node[rank] == averages[rank] * MODEL_BYTES + sent_broadcast
    assert sum(calls) > 0 and sum(averages) == 3 * 2  # 3 rounds of 2 participants
