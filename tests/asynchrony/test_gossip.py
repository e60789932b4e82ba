"""Gossip against a hand-computed replay: node i pulls towards its own target T_i; every H steps the nodes mix on
the topology (sync) or by push-sum in the order of the simulated clock (async)."""

import math
import random

import pytest
import torch
from torch.utils.data import TensorDataset

import replay
import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import GossipStrategy, OptimSpec
from exogym.strategy.gossip import neighbours

FIT = dict(progress=False, device="cpu", logger=False)
K, ETA, B, LAT = 4, 0.25, 8, 0.5
TARGETS = torch.tensor([[float(i), -2.0 * i] for i in range(K)], dtype=torch.float64)


def own_data(rank, num_nodes, is_val):
    return TensorDataset(TARGETS[rank].float().repeat(32, 1), torch.zeros(32))


class Logged(GossipStrategy):
    def finish(self):
        super().finish()
        toy.REGISTRY[("x", self.rank)] = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def _fit(steps, speeds=None, **kw):
    t = Trainer(replay.Pull(), own_data)
    model = t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), **kw), K, batch_size=B, max_steps=steps,
                  node_speeds=speeds, device_flops=replay.flops_per_step(B),
                  network=Network(bandwidth="inf", latency=LAT), **FIT)
    return t, model, torch.stack([toy.REGISTRY[("x", r)] for r in range(K)]).double()


def _local(x, i):
    return x - ETA * (x - TARGETS[i])


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "random_pairs"])
def test_sync_gossip_is_the_hand_mixing(topology):
    H, steps = 2, 6
    t, model, got = _fit(steps, topology=topology, H=H)
    x = torch.zeros(K, 2, dtype=torch.float64)
    for step in range(1, steps + 1):
        x = torch.stack([_local(x[i], i) for i in range(K)])
        if step % H == 0:
            r = step // H - 1
            mixed = []
            for i in range(K):
                _, into = neighbours(topology, i, K, r, 0)
                mixed.append((x[i] + sum(x[j] for j in into)) / (1 + len(into)))
            x = torch.stack(mixed)
    torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.w.detach().double(), x.mean(0), rtol=1e-5, atol=1e-6)
    assert t.record.comm_per_node[0]["bytes_received"] > 0


def test_the_topologies():
    assert neighbours("ring", 0, 4, 0, 0) == ([1, 3], [1, 3])
    assert neighbours("torus", 4, 9, 0, 0) == ([1, 3, 5, 7], [1, 3, 5, 7])  # the middle of a 3 x 3 grid
    assert neighbours("exponential", 0, 8, 0, 0) == ([1], [7]) and neighbours("exponential", 0, 8, 2, 0) == ([4], [4])
    pairs = [neighbours("random_pairs", r, 5, 3, 1)[0] for r in range(5)]
    assert sorted(len(p) for p in pairs) == [0, 1, 1, 1, 1]  # a matching, one node out
    assert all(pairs[p[0]] == [r] for r, p in enumerate(pairs) if p)


def test_async_push_sum_is_the_hand_replay_in_simulated_time_order():
    H, steps, speeds = 1, 6, [1.0, 0.5, 0.25, 1.0]
    _, model, got = _fit(steps, speeds, topology="ring", mode="async", H=H)
    rngs = [random.Random(0 * 7919 + r) for r in range(K)]
    x, w = torch.zeros(K, 2, dtype=torch.float64), [1.0] * K
    inbox = {i: [] for i in range(K)}  # (arrival, src, seq, x, w)
    taken = {i: 0 for i in range(K)}
    # node i's k-th gossip point is at k / s_i seconds (a step's compute is 1 s at speed 1; isend does not wait)
    points = sorted((k / s, i, k) for i, s in enumerate(speeds) for k in range(1, steps + 1))
    seq = [0] * K

    def fold(i, msgs):
        nonlocal x
        if msgs:
            acc = x[i] * w[i]
            for m in msgs:
                acc = acc + m[3] * m[4]
                w[i] += m[4]
            x[i] = acc / w[i]

    for t, i, k in points:
        x[i] = _local(x[i], i)
        arrived = sorted(m for m in inbox[i] if m[0] <= t)
        inbox[i] = [m for m in inbox[i] if m[0] > t]
        taken[i] += len(arrived)
        fold(i, arrived)
        j = rngs[i].choice(neighbours("ring", i, K, 0, 0)[0])
        w[i] /= 2
        inbox[j].append((t + LAT, i, seq[i], x[i].clone(), w[i]))
        seq[i] += 1
    for i in range(K):  # the end: every message still in flight, from each sender in arrival order
        for src in range(K):
            fold(i, sorted(m for m in inbox[i] if m[1] == src))
    torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-6)
    assert math.isclose(sum(w), K)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="topology must be one of"):
        GossipStrategy(topology="star")
    with pytest.raises(ValueError, match="mode must be"):
        GossipStrategy(mode="semi")
    GossipStrategy(topology="random_pairs", mode="async", H=1)
