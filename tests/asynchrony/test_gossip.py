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


def _fit(steps, speeds=None, failures=None, **kw):
    for r in range(K):
        toy.REGISTRY.pop(("x", r), None)
    t = Trainer(replay.Pull(), own_data)
    model = t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), **kw), K, batch_size=B, max_steps=steps,
                  node_speeds=speeds, device_flops=replay.flops_per_step(B), failures=failures,
                  network=Network(bandwidth="inf", latency=LAT), **FIT)
    # a node down at the end does not finish: its row stays nan
    got = [toy.REGISTRY.get(("x", r), torch.full((2,), float("nan"))) for r in range(K)]
    return t, model, torch.stack(got).double()


def _down(failures, i, step):
    return any(n == i and a <= step and (b is None or step < b) for n, a, b in failures or ())


def _local(x, i):
    return x - ETA * (x - TARGETS[i])


@pytest.mark.parametrize("topology", ["ring", "torus", "exponential", "random_pairs"])
@pytest.mark.parametrize("failures", [None, [(2, 3, 6)], [(1, 2, None), (3, 4, 5)]], ids=["up", "back", "gone"])
def test_sync_gossip_is_the_hand_mixing(topology, failures):
    # Under failures: a round mixes the nodes up with their neighbours up; a node coming back first takes the mean
    # of the nodes that stayed up (the hand-over); a node down keeps its model and computes nothing.
    H, steps = 2, 6
    t, model, got = _fit(steps, topology=topology, H=H, failures=failures)
    x = torch.zeros(K, 2, dtype=torch.float64)
    for step in range(1, steps + 1):
        up = [i for i in range(K) if not _down(failures, i, step)]
        stayed = [i for i in up if step == 1 or not _down(failures, i, step - 1)]
        for j in set(up) - set(stayed):
            x[j] = sum(x[i] for i in stayed) / len(stayed)
        x = torch.stack([_local(x[i], i) if i in up else x[i] for i in range(K)])
        if step % H == 0:
            r = step // H - 1
            mixed = []
            for i in range(K):
                into = [j for j in neighbours(topology, i, K, r, 0)[1] if j in up]
                mixed.append((x[i] + sum(x[j] for j in into)) / (1 + len(into)) if i in up else x[i])
            x = torch.stack(mixed)
    up = [i for i in range(K) if not _down(failures, i, steps)]
    torch.testing.assert_close(got[up], x[up], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.w.detach().double(), x[up].mean(0), rtol=1e-5, atol=1e-6)
    assert t.record.comm_per_node[0]["bytes_received"] > 0


def test_the_topologies():
    assert neighbours("ring", 0, 4, 0, 0) == ([1, 3], [1, 3])
    assert neighbours("torus", 4, 9, 0, 0) == ([1, 3, 5, 7], [1, 3, 5, 7])  # the middle of a 3 x 3 grid
    assert neighbours("exponential", 0, 8, 0, 0) == ([1], [7]) and neighbours("exponential", 0, 8, 2, 0) == ([4], [4])
    pairs = [neighbours("random_pairs", r, 5, 3, 1)[0] for r in range(5)]
    assert sorted(len(p) for p in pairs) == [0, 1, 1, 1, 1]  # a matching, one node out
    assert all(pairs[p[0]] == [r] for r, p in enumerate(pairs) if p)


@pytest.mark.parametrize("failures", [None, [(1, 3, 5)], [(2, 4, None)]], ids=["up", "back", "gone"])
def test_async_push_sum_is_the_hand_replay_in_simulated_time_order(failures):
    # Under failures: a node sends to a neighbour up at its step (none: it keeps its weight); a node down computes
    # nothing, its clock running on, and comes back alone, first folding in what reached it; at the end the nodes
    # up take in what the nodes up sent them.
    H, steps, speeds = 1, 6, [1.0, 0.5, 0.25, 1.0]
    _, model, got = _fit(steps, speeds, failures, topology="ring", mode="async", H=H)
    rngs = [random.Random(0 * 7919 + r) for r in range(K)]
    x, w = torch.zeros(K, 2, dtype=torch.float64), [1.0] * K
    inbox = {i: [] for i in range(K)}  # (arrival, src, seq, x, w)
    taken = {i: 0 for i in range(K)}
    # node i's k-th gossip point is at k / s_i seconds (a step's compute is 1 s at speed 1; isend does not wait);
    # a node coming back at step k takes in its mail at (k - 1) / s_i, before computing (kind 0)
    points = sorted((k / s, i, k, 1) for i, s in enumerate(speeds) for k in range(1, steps + 1)
                    if not _down(failures, i, k))
    points = sorted(points + [((k - 1) / s, i, k, 0) for i, s in enumerate(speeds) for k in range(2, steps + 1)
                              if _down(failures, i, k - 1) and not _down(failures, i, k)])
    seq = [0] * K

    def fold(i, msgs):
        nonlocal x
        if msgs:
            acc = x[i] * w[i]
            for m in msgs:
                acc = acc + m[3] * m[4]
                w[i] += m[4]
            x[i] = acc / w[i]

    for t, i, k, computes in points:
        if computes:
            x[i] = _local(x[i], i)
        arrived = sorted(m for m in inbox[i] if m[0] <= t)
        inbox[i] = [m for m in inbox[i] if m[0] > t]
        taken[i] += len(arrived)
        fold(i, arrived)
        up = [j for j in neighbours("ring", i, K, 0, 0)[0] if not _down(failures, j, k)]
        if not computes or not up:
            continue
        j = rngs[i].choice(up)
        w[i] /= 2
        inbox[j].append((t + LAT, i, seq[i], x[i].clone(), w[i]))
        seq[i] += 1
    up = [i for i in range(K) if not _down(failures, i, steps)]
    for i in up:  # the end: every message still in flight from the nodes up, from each sender in arrival order
        for src in up:
            fold(i, sorted(m for m in inbox[i] if m[1] == src))
    torch.testing.assert_close(got[up], x[up], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.w.detach().double(), x[up].mean(0), rtol=1e-5, atol=1e-6)
    assert math.isclose(sum(w), K) == (len(up) == K)  # weight is lost only with a node down at the end


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="topology must be one of"):
        GossipStrategy(topology="star")
    with pytest.raises(ValueError, match="mode must be"):
        GossipStrategy(mode="semi")
    GossipStrategy(topology="random_pairs", mode="async", H=1)


def _five(mode, processes, failures):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    model = t.fit(GossipStrategy(topology="ring", mode=mode, H=2, lr=0.05), 5, max_steps=12, processes=processes,
                  failures=failures, batch_size=8, node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5], network="home",
                  val_interval=4, **FIT)
    r = t.record
    return [p.detach().clone() for p in model.parameters()], (r.val, r.node_loss, r.bytes_per_node, r.sim_time_per_node)


@pytest.mark.spawns
def test_gossip_under_failures_over_two_processes():
    # Node 3 (in the second process, with node 4) is down for steps 3-6, node 1 from step 5 on. Async gossip talks
    # only by messages: the same bits. Sync gossip's comeback is a mean over the nodes that stayed up (a strategy's
    # sum, added per process across processes): the same records, parameters to float rounding.
    failures = [(3, 3, 7), (1, 5, None)]
    one, many = _five("async", 1, failures), _five("async", 2, failures)
    assert all(torch.equal(a, b) for a, b in zip(one[0], many[0])) and one[1] == many[1]
    one, many = _five("sync", 1, failures), _five("sync", 2, failures)
    for a, b in zip(one[0], many[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert one[1][2:] == many[1][2:]  # bytes and simulated times


def test_async_gossip_counts_as_traffic_only_what_it_sent():
    # Issue 46: the end of the run once all-reduced a K x K count matrix and counted it as each node's traffic
    # (node 0 at K=16: 10,800 bytes where 6,880 were sent). Bookkeeping is not traffic: with H=1 every node pushes
    # its model and its weight (8 bytes) to one neighbour per step, and that is all it sends.
    k, steps = 16, 10
    model = toy.TinyMLP()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    t = Trainer(model, toy.make_classification(256))
    t.fit(GossipStrategy(topology="ring", mode="async", H=1, lr=0.05), k, max_steps=steps, batch_size=8, **FIT)
    assert t.record.bytes_per_node == [steps * (model_bytes + 8)] * k
