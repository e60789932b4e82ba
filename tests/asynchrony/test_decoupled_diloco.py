"""Decoupled DiLoCo against a hand-computed replay: quorum, grace window, token weights, fragments."""

import math

import pytest
import torch

import replay
import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import DecoupledDiLoCoStrategy, OptimSpec
from exogym.strategy.decoupled_diloco import fragment_slices

FIT = dict(progress=False, device="cpu", logger=False)
SPEEDS, ETA, LAT, B = [1.0, 0.5, 0.25], 0.25, 0.5, 8


class Logged(DecoupledDiLoCoStrategy):
    def make_server(self, theta, num_nodes):
        server = super().make_server(theta, num_nodes)
        merge = server._merge

        def logged(p, node):
            merge(p, node)
            toy.REGISTRY["theta"].append(server.theta.clone())
        server._merge = logged
        return server


def _fit(H, steps, **kw):
    toy.REGISTRY["theta"] = []
    t = Trainer(replay.Pull(), replay.data())
    t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), H=H, **kw), 3, batch_size=B, max_steps=steps,
          node_speeds=SPEEDS, device_flops=replay.flops_per_step(B), network=Network(bandwidth="inf", latency=LAT),
          **FIT)
    return t


def _messages(steps, every, F):
    """Each learner's messages in order: (inner steps before it, fragment, its weight = steps since that fragment
    was last sent); every `every` steps the next fragment in turn, then at the end each fragment with unsent steps."""
    out, since = [], [0] * F
    for k in range(steps // every):
        since = [x + every for x in since]
        p = k % F
        out.append((every, p, since[p]))
        since[p] = 0
    out += [(0, p, since[p]) for p in range(F) if since[p]]
    return out


def _replay(H, steps, F, quorum, grace_factor, lr=0.7, beta=0.9):
    """The syncer's rule, by hand: learner i's j-th message (from 1) arrives after its inner steps so far at 1/s_i
    seconds each and 2j - 1 one-way latencies; timers at quorum time + grace."""
    import heapq
    every = H // F
    sl = fragment_slices(2, F)
    heap = []
    for i, s in enumerate(SPEEDS):
        done = 0
        for j, (inner, p, w) in enumerate(_messages(steps, every, F), start=1):
            done += inner
            heap.append((done / s + (2 * j - 1) * LAT, 0, i, j, (inner, p, w)))
    heapq.heapify(heap)
    theta, m = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    versions, pending, first, deadline, out = [0] * F, [dict() for _ in range(F)], [None] * F, [None] * F, []
    start = {i: theta.clone() for i in range(3)}
    params = {i: theta.clone() for i in range(3)}
    version_of = {i: [0] * F for i in range(3)}

    def merge(p, node, t):
        total = sum(w for _, w, _ in pending[p].values())
        delta = sum(d * (w / total) for d, w, _ in pending[p].values())
        m[sl[p]] = beta * m[sl[p]] + delta
        theta[sl[p]] -= lr * (delta + beta * m[sl[p]])
        versions[p] += 1
        out.append((t, node, p, len(pending[p]), theta.clone()))
        pending[p].clear()
        first[p] = deadline[p] = None

    while heap:
        t, kind, i, _, item = heapq.heappop(heap)
        if kind == -1:  # a timer: sorts before the arrivals at its time
            if deadline[item] == t:
                merge(item, -1, t)
            continue
        inner, p, w = item
        params[i] = replay.after_inner_steps(params[i], inner, ETA)
        e = pending[p].setdefault(i, [torch.zeros(sl[p].stop - sl[p].start, dtype=torch.float64), 0, 0])
        e[0] += start[i][sl[p]] - params[i][sl[p]]
        e[1] += w
        e[2] = max(e[2], versions[p] - version_of[i][p])
        if first[p] is None:
            first[p] = t
        if len(pending[p]) == 3:
            merge(p, i, t)
        elif len(pending[p]) >= quorum and deadline[p] is None:
            deadline[p] = t + grace_factor * (t - first[p])
            heapq.heappush(heap, (deadline[p], -1, -1, -1, p))
        start[i][sl[p]] = theta[sl[p]]
        params[i][sl[p]] = theta[sl[p]]
        version_of[i][p] = versions[p]
    return out


def _check(t, expected):
    rows = t.record.updates
    assert [(u["node"], u["fragment"], u["quorum"]) for u in rows] == [(n, p, q) for _, n, p, q, _ in expected]
    for u, e in zip(rows, expected):
        assert math.isclose(u["sim_time_s"], e[0], rel_tol=1e-12)
    for got, e in zip(toy.REGISTRY["theta"], expected):
        torch.testing.assert_close(got.double(), e[4], rtol=1e-5, atol=1e-6)
    assert len(rows) == len(expected) > 0


@pytest.mark.parametrize("quorum, grace", [(2, 0.0), (2, 0.5), (1, 0.0), (3, 0.0)])
def test_the_syncer_merges_as_a_hand_replay_says(quorum, grace):
    t = _fit(2, 8, min_quorum=quorum, grace_factor=grace)
    _check(t, _replay(2, 8, 1, quorum, grace))


def test_fragments_take_turns():
    t = _fit(4, 8, fragments=2, min_quorum=2, grace_factor=0.5)
    expected = _replay(4, 8, 2, 2, 0.5)
    assert {p for _, _, p, _, _ in expected} == {0, 1}
    _check(t, expected)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="H must be a multiple of fragments"):
        DecoupledDiLoCoStrategy(H=10, fragments=3)
    with pytest.raises(ValueError, match="min_quorum=4 is more than num_nodes=3"):
        Trainer(replay.Pull(), replay.data()).fit(DecoupledDiLoCoStrategy(H=2, min_quorum=4), 3, max_steps=2, **FIT)
    DecoupledDiLoCoStrategy(H=3, fragments=3, min_quorum=1, grace_factor=0.0, max_grace=0.0)
