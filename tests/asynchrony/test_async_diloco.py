"""AsyncDiLoCo against a hand-computed replay: the server's parameters update by update, in the order finish times
give; staleness weighting, Delayed Nesterov, Dynamic Local Updates."""

import math

import pytest
import torch

import replay  # noqa: I001
import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
from exogym.strategy.async_diloco import AsyncDiLoCoServer

FIT = dict(progress=False, device="cpu", logger=False)
SPEEDS, H, ETA, LAT, B = [1.0, 0.5, 0.25], 2, 0.25, 0.5, 8


class Logged(AsyncDiLoCoStrategy):
    """Keeps the server's theta after every update (toy.REGISTRY["theta"])."""

    def make_server(self, theta, num_nodes):
        server = super().make_server(theta, num_nodes)
        apply = server.apply

        def logged(message, staleness):
            apply(message, staleness)
            toy.REGISTRY["theta"].append(server.theta.clone())
        server.apply = logged
        return server


def _fit(steps=4, execution="sequential", **kw):
    toy.REGISTRY["theta"] = []
    t = Trainer(replay.Pull(), replay.data())
    t.returned = t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), H=H, **kw), 3, batch_size=B, max_steps=steps,
          node_speeds=SPEEDS, device_flops=replay.flops_per_step(B), compute_time="flops",
          network=Network(bandwidth="inf", latency=LAT), execution=execution, **FIT)
    return t


def _replay(rounds, *, lr=0.7, beta=0.9, delay=1, weight=lambda tau: 1.0, rule="full_steps", c=0.0):
    """The server's theta after each update, from the finish times alone (float64). rule "paper": Algorithm 3 of
    Liu et al. 2024 as its text states it, with N = delay and momentum activation c; "full_steps": ExoGym's earlier
    reading (each g at full size); "buffered": the toy simulator's delayed_sgd (theta still between momentum steps)."""
    theta, m, buf = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    version, start = 0, {i: (0, theta.clone()) for i in range(3)}  # node -> (version, theta) it started from
    out = []
    for t, node, _ in replay.arrivals([1.0 / s for s in SPEEDS], rounds, H, LAT):
        v0, th0 = start[node]
        tau = version - v0
        g = weight(tau) * (th0 - replay.after_inner_steps(th0, H, ETA))
        buf += g
        n = delay
        if (len(out) + 1) % n == 0:  # the N-th arrival: the momentum step
            mean = buf / n
            m = beta * m + mean
            buf = torch.zeros_like(buf)
            if rule == "paper":
                theta = theta - lr * ((1 - c * n + c) * beta * m + g / n)
            elif rule == "buffered":
                theta = theta - lr * (mean + beta * m)
            else:
                theta = theta - lr * (g + beta * m)
        elif rule == "paper":
            theta = theta - lr * (c * beta * m + g / n)
        elif rule == "full_steps":
            theta = theta - lr * g
        version += 1
        start[node] = (version, theta.clone())
        out.append((t, node, tau, theta))
    return out


def _check(record, expected):
    got = toy.REGISTRY["theta"]
    assert [(u["node"], u["staleness"]) for u in record.updates] == [(n, tau) for _, n, tau, _ in expected]
    for u, (t, _, _, _) in zip(record.updates, expected):
        assert math.isclose(u["sim_time_s"], t, rel_tol=1e-12)
    for theta, (_, _, _, want) in zip(got, expected):
        torch.testing.assert_close(theta.double(), want, rtol=1e-5, atol=1e-6)
    assert len(got) == len(expected)


def test_the_server_applies_updates_in_the_order_of_the_hand_computed_finish_times():
    t = _fit()
    expected = _replay(2)
    # node 0 arrives at 2.5 and 5.5 s, node 1 at 4.5 and 9.5 s, node 2 at 8.5 and 17.5 s
    assert [(n, tau) for _, n, tau, _ in expected] == [(0, 0), (1, 1), (0, 1), (2, 3), (1, 2), (2, 1)]
    _check(t.record, expected)
    # the returned model is the server's last theta
    torch.testing.assert_close(t.returned.w.detach().double(), expected[-1][3], rtol=1e-5, atol=1e-6)


def test_polynomial_staleness_weighting():
    t = _fit(staleness="polynomial", staleness_power=0.5)
    expected = _replay(2, weight=lambda tau: (1 + tau) ** -0.5)
    _check(t.record, expected)
    assert [u["weight"] for u in t.record.updates] == [(1 + tau) ** -0.5 for _, _, tau, _ in expected]


@pytest.mark.parametrize("c", [0.0, 0.25])
def test_delayed_nesterov_is_the_papers_algorithm_3_update_by_update(c):
    # N = 3 over six arrivals: momentum steps at the 3rd and 6th; with c > 0 the momentum of the 3rd acts at the
    # 4th and 5th (c beta m) and the 6th applies the rest ((1 - cN + c) beta m)
    t = _fit(delayed_nesterov=True, nesterov_delay=3, momentum_activation=c)
    expected = _replay(2, delay=3, rule="paper", c=c)
    _check(t.record, expected)
    assert [u["momentum_step"] for u in t.record.updates] == [0, 0, 1, 0, 0, 1]
    other = _replay(2, delay=3, rule="paper", c=0.25 - c)  # the reference tells c = 0 from c = 0.25
    assert not torch.allclose(other[2][3], expected[2][3], atol=1e-3)


def test_delayed_nesterov_by_default_delays_by_num_nodes_and_differs_from_the_earlier_reading():
    t = _fit(delayed_nesterov=True)
    _check(t.record, _replay(2, delay=3, rule="paper"))
    assert not torch.allclose(_replay(2, delay=3, rule="paper")[1][3], _replay(2, delay=3)[1][3], atol=1e-3)


@pytest.mark.parametrize("variant", ["full_steps", "buffered"])
def test_the_named_delayed_variants(variant):
    t = _fit(delayed_nesterov=variant, nesterov_delay=2)
    _check(t.record, _replay(2, delay=2, rule=variant))
    assert [u["momentum_step"] for u in t.record.updates] == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize("variant", [True, "full_steps"])
def test_delayed_nesterov_with_delay_one_is_nesterov(variant):
    a = _fit(delayed_nesterov=variant, nesterov_delay=1)
    first = [x.clone() for x in toy.REGISTRY["theta"]]
    _fit()
    assert all(torch.equal(x, y) for x, y in zip(first, toy.REGISTRY["theta"]))
    assert a.record.updates


def test_dynamic_local_updates_scale_each_nodes_steps_by_its_speed():
    t = _fit(steps=8, dynamic_local_updates=True)
    steps = {n: [u["steps"] for u in t.record.updates if u["node"] == n] for n in range(3)}
    # the first round is H everywhere; then H_i = max(1, floor(H v_i / v_max)) = 2, 1, 1
    assert steps[0][:2] == [2, 2] and steps[1][:2] == [2, 1] and steps[2][:2] == [2, 1]


def test_same_seed_same_bits_and_the_same_under_fused_execution():
    a = _fit(staleness="polynomial")
    first = [x.clone() for x in toy.REGISTRY["theta"]]
    b = _fit(staleness="polynomial", execution="fused")
    assert all(torch.equal(x, y) for x, y in zip(first, toy.REGISTRY["theta"]))
    assert a.record.updates == b.record.updates


@pytest.mark.parametrize("kw, message", [
    (dict(H=0), "H"), (dict(staleness="linear"), "staleness must be one of"),
    (dict(outer_momentum=1.0), r"outer_momentum must be in \[0, 1\)"),
    (dict(nesterov_delay=2), "only means something with delayed_nesterov"),
    (dict(delayed_nesterov=True, outer_momentum=0.0), "needs outer_momentum > 0"),
    (dict(delayed_nesterov="paper"), "must be True"), (dict(delayed_nesterov=1), "must be True"),
    (dict(momentum_activation=0.1), "only means something with delayed_nesterov=True"),
    (dict(delayed_nesterov="buffered", momentum_activation=0.1), "only means something"),
    (dict(delayed_nesterov=True, nesterov_delay=4, momentum_activation=0.3), r"at most 1/N = 1/4"),
    (dict(delayed_nesterov=True, momentum_activation=-0.1), "momentum_activation"),
    (dict(grace_s=-1.0), "grace_s"), (dict(grace_s=math.inf), "grace_s"),
    (dict(dynamic_local_updates="measured"), "dynamic_local_updates must be"),
    (dict(min_local_steps=2), "only means something with dynamic_local_updates"),
    (dict(dynamic_local_updates="speeds", H=4, min_local_steps=5), "more than H=4"),
    (dict(shard_sampling="random"), "shard_sampling must be"),
    (dict(shard_seed=1), "only means something with shard_sampling"),
    (dict(shard_steps=100), "only means something with shard_sampling"),
    (dict(shard_sampling="least_visited", shard_steps=0), "shard_steps"),
    (dict(shard_sampling="least_visited", lr_scheduler=torch.optim.lr_scheduler.StepLR,
          lr_scheduler_kwargs={"step_size": 2}), "per shard"),
    (dict(inner_state="fresh"), "inner_state must be")])
def test_arguments_are_checked(kw, message):
    with pytest.raises((ValueError, TypeError), match=message):
        AsyncDiLoCoStrategy(**kw)


def test_the_boundary_values_are_accepted():
    AsyncDiLoCoStrategy(H=1, outer_momentum=0.0, staleness="polynomial", staleness_power=0.0)
    AsyncDiLoCoStrategy(delayed_nesterov=True, nesterov_delay=1)
    AsyncDiLoCoStrategy(delayed_nesterov=True, nesterov_delay=4, momentum_activation=0.25, grace_s=0.0)
    AsyncDiLoCoStrategy(dynamic_local_updates="speeds", H=4, min_local_steps=4, shard_sampling="undersampled",
                        shard_seed=0, inner_state="reset", lr_scheduler="lambda_cosine", cosine_anneal=True)


def test_momentum_activation_above_one_over_num_nodes_is_refused_before_any_node_starts():
    with pytest.raises(ValueError, match=r"at most 1/N = 1/3 \(N = nesterov_delay, by default num_nodes=3\)"):
        Trainer(replay.Pull(), replay.data()).fit(
            AsyncDiLoCoStrategy(H=2, delayed_nesterov=True, momentum_activation=0.4), 3, max_steps=2, **FIT)


def test_a_node_down_never_stalls_the_server_and_comes_back_with_the_current_global_model():
    # node 2 is down for steps 2..5: nodes 0 and 1 go on; at step 6 node 2 asks the server for theta
    toy.REGISTRY["theta"] = []
    t = Trainer(replay.Pull(), replay.data())
    t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), H=H), 3, batch_size=B, max_steps=8, node_speeds=SPEEDS,
          device_flops=replay.flops_per_step(B), network=Network(bandwidth="inf", latency=LAT),
          failures=[(2, 2, 6)], **FIT)
    rows = t.record.updates
    by_node = {n: [u for u in rows if u["node"] == n] for n in range(3)}
    assert len(by_node[0]) == 4 and len(by_node[1]) == 4  # never stalled: every round of the nodes up applied
    # node 2 lost its half round (step 1) and made one round (steps 6-7) and the last step (8) after coming back
    assert [u["steps"] for u in by_node[2]] == [2, 1]
    # its first update after coming back started from the version the server had when it asked (small staleness)
    first_back = by_node[2][0]
    before = [u for u in rows if u["sim_time_s"] < first_back["sim_time_s"]]
    assert first_back["staleness"] < len(before)
    # down time passes on its clock: 4 steps idle at its speed (4 s each)
    assert t.record.sim_time_per_node[2]["wait_s"] >= 4 * 4.0


def test_a_time_budget_lets_fast_nodes_train_more_steps():
    toy.REGISTRY["theta"] = []
    t = Trainer(replay.Pull(), replay.data())
    t.fit(Logged(OptimSpec(torch.optim.SGD, lr=ETA), H=H, time_budget_s=8.0), 3, batch_size=B, max_steps=12,
          node_speeds=SPEEDS, device_flops=replay.flops_per_step(B), network=Network(bandwidth="inf", latency=LAT),
          **FIT)
    steps = [sum(u["steps"] for u in t.record.updates if u["node"] == n) for n in range(3)]
    # compute 1, 2, 4 s per step plus 1 s per round trip every 2 steps; a node starts a step while its clock is
    # below 8 s: node 0 at 0,1,3,4,6,7 (6 steps), node 1 at 0,2,5,7 (4), node 2 at 0,4 (2)
    assert steps == [6, 4, 2]
    assert [sum(1 for x in row if x == x) for row in t.record.node_loss] == steps  # the rest sat out (nan)
