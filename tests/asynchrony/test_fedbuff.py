"""FedBuff against a hand-computed replay: buffered, staleness-weighted updates, every K arrivals."""

import math

import pytest
import torch

import replay
import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import FedBuffStrategy, OptimSpec

FIT = dict(progress=False, device="cpu", logger=False)
SPEEDS, H, ETA, LAT, B = [1.0, 0.5, 0.25], 2, 0.25, 0.5, 8


class Logged(FedBuffStrategy):
    def make_server(self, theta, num_nodes):
        server = super().make_server(theta, num_nodes)
        apply = server.apply

        def logged(message, staleness):
            version = server.version
            apply(message, staleness)
            if server.version != version:
                toy.REGISTRY["theta"].append(server.theta.clone())
        server.apply = logged
        return server


def _fit(**kw):
    toy.REGISTRY["theta"] = []
    t = Trainer(replay.Pull(), replay.data())
    t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), H=H, **kw), 3, batch_size=B, max_steps=6,
          node_speeds=SPEEDS, device_flops=replay.flops_per_step(B), network=Network(bandwidth="inf", latency=LAT),
          **FIT)
    return t


def _replay(K, lr, weight):
    theta = torch.zeros(2, dtype=torch.float64)
    version, start, buf, count, out = 0, {i: (0, theta.clone()) for i in range(3)}, torch.zeros(2, dtype=torch.float64), [], []
    for t, node, _ in replay.arrivals([1.0 / s for s in SPEEDS], 3, H, LAT):
        v0, th0 = start[node]
        tau = version - v0
        buf += weight(tau) * (th0 - replay.after_inner_steps(th0, H, ETA))
        count.append(tau)
        if len(count) == K:
            theta = theta - lr * buf / K
            buf, version = torch.zeros_like(buf), version + 1
            out.append((t, node, max(count), theta.clone()))
            count = []
        start[node] = (version, theta.clone())
    return out


@pytest.mark.parametrize("K, lr, rule", [(2, 1.0, "sqrt"), (3, 0.5, "constant"), (1, 1.0, "sqrt")])
def test_the_server_updates_every_k_arrivals_as_a_hand_replay_says(K, lr, rule):
    t = _fit(buffer_size=K, server_lr=lr, staleness=rule)
    expected = _replay(K, lr, (lambda tau: (1 + tau) ** -0.5) if rule == "sqrt" else (lambda tau: 1.0))
    rows = t.record.updates
    assert [(u["node"], u["staleness"], u["quorum"]) for u in rows] == [(n, tau, K) for _, n, tau, _ in expected]
    for u, (when, _, _, theta) in zip(rows, expected):
        assert math.isclose(u["sim_time_s"], when, rel_tol=1e-12)
    for got, (_, _, _, want) in zip(toy.REGISTRY["theta"], expected):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert len(toy.REGISTRY["theta"]) == len(expected) == 9 // K


@pytest.mark.parametrize("kw, message", [(dict(buffer_size=0), "buffer_size"), (dict(server_lr=0.0), "server_lr"),
                                         (dict(staleness="poly"), "staleness must be")])
def test_arguments_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        FedBuffStrategy(**kw)


def test_the_boundary_values_are_accepted():
    FedBuffStrategy(H=1, buffer_size=1, server_lr=1e-9, staleness="constant")
