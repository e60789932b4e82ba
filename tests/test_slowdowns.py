"""Transient slowdowns ("chaos", exogym.cluster.slowdowns): hand-computed simulated times, drawn from a seed the same
way whatever the run, recorded, and refused when wrong."""

import json
import math
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "asynchrony"))
import replay  # noqa: E402
import toy  # noqa: E402
from exogym import RandomSlowdowns, Trainer  # noqa: E402
from exogym.cluster.network import Network  # noqa: E402
from exogym.cluster.slowdowns import SlowdownSchedule, build_slowdowns  # noqa: E402
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec, SimpleReduceStrategy  # noqa: E402

B = 8
FIT = dict(progress=False, device="cpu", logger=False, batch_size=B)


def _ddp(slowdowns, *, steps=3, step_s=1.0, **kw):
    """Two nodes averaging gradients every step on a network of no latency: each step waits for the slower one."""
    t = Trainer(replay.Pull(), replay.data())
    t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.25)), 2, max_steps=steps,
          device_flops=replay.flops_per_step(B) / step_s, network=Network(bandwidth="inf", latency=0.0),
          slowdowns=slowdowns, **FIT, **kw)
    return t.record


def test_one_window_by_hand_a_slow_node_makes_the_other_wait():
    # Steps of 1 s; node 1 computes twice as slowly from 0.5 s to 2.5 s. Step 1: node 1 does 0.5 s of work by 0.5,
    # the other 0.5 at half speed by 1.5 (node 0 waits 0.5). Step 2 from 1.5: half speed until 2.5 (0.5 of work),
    # the rest at full speed by 3.0 (node 0 waits 0.5). Step 3: 3.0 to 4.0, untouched.
    r = _ddp([(1, 0.5, 2.5, 2.0)])
    assert [row["sim_time_s"] for row in r.train] == [1.5, 3.0, 4.0]
    assert r.sim_time_per_node == [{"now": 4.0, "compute_s": 3.0, "comm_s": 0.0, "wait_s": 1.0},
                                   {"now": 4.0, "compute_s": 3.0, "comm_s": 0.0, "wait_s": 0.0, "slowed_s": 1.0}]
    assert r.time_per_node[0]["idle_s"] == 1.0 and r.time_per_node[1]["slowed_s"] == 1.0
    assert r.goodput == 6.0 / 8.0  # the slowed second is neither useful compute nor idle
    assert r.slowdowns == [{"node": 1, "from_s": 0.5, "to_s": 2.5, "factor": 2.0}]
    # without it: 3 s, nobody waits, and the record has no trace of slowdowns
    plain = _ddp(None)
    assert plain.sim_time_s == 3.0 and "slowed_s" not in plain.sim_time_per_node[1] and plain.slowdowns == []


def test_one_drawn_slowdown_by_hand():
    # RandomSlowdowns draws node r's windows from numpy's default_rng([seed, r]), in order: the exponential gap
    # (mean 1/rate), then the duration and the factor where they are ranges. Seed 13 at rate 0.02 draws one window
    # in this 24 s run, on node 1.
    spec = RandomSlowdowns(rate=0.02, factor=(2.0, 4.0), duration=2.0, seed=13)
    r = _ddp(spec, steps=6, step_s=4.0)
    rng = np.random.default_rng([13, 1])
    start = float(rng.exponential(1 / 0.02))
    factor = float(rng.uniform(2.0, 4.0))
    assert r.slowdowns == [{"node": 1, "from_s": start, "to_s": start + 2.0, "factor": factor}]
    # The window lies inside node 1's compute (it never waits: it is the slower one), so the run is longer by the
    # window's length less the work done in it: 2 (1 - 1/factor); node 0 waits that long.
    slowed = 2.0 * (1 - 1 / factor)
    assert math.isclose(r.sim_time_s, 24.0 + slowed, rel_tol=1e-12)
    assert math.isclose(r.sim_time_per_node[1]["slowed_s"], slowed, rel_tol=1e-9)
    assert math.isclose(r.sim_time_per_node[0]["wait_s"], slowed, rel_tol=1e-9)
    assert r.sim_time_per_node[0]["compute_s"] == r.sim_time_per_node[1]["compute_s"] == 24.0


def test_a_slowed_node_applies_fewer_updates_in_the_same_time():
    # AsyncDiLoCo with a budget of 8 s (tests/asynchrony/test_async_diloco.py): steps of 1, 2 and 4 s and a 1 s
    # round trip every 2 steps give [6, 4, 2] steps. Node 0 at half speed from 0 to 4 s: steps 0-2, 2-4, the round
    # trip to 5, steps 5-6, 6-7, the round trip to 8: 4 steps, 2 updates instead of 3.
    def steps(slowdowns):
        t = Trainer(replay.Pull(), replay.data())
        t.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2, time_budget_s=8.0), 3, max_steps=12,
              node_speeds=[1.0, 0.5, 0.25], device_flops=replay.flops_per_step(B),
              network=Network(bandwidth="inf", latency=0.5), slowdowns=slowdowns, **FIT)
        return [sum(u["steps"] for u in t.record.updates if u["node"] == n) for n in range(3)], t.record
    assert steps(None)[0] == [6, 4, 2]
    got, record = steps([(0, 0.0, 4.0, 2.0)])
    assert got == [4, 4, 2] and sum(u["node"] == 0 for u in record.updates) == 2


CHAOS = RandomSlowdowns(rate=2.0, factor=(1.5, 3.0), duration=(0.05, 0.2), seed=7)  # runs of about 1 s


def _diloco(execution="sequential", **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    model = t.fit(DiLoCoStrategy(H=3, lr=1e-2), 3, max_steps=12, node_speeds=[1.0, 0.7, 0.4], network="home",
                  device_flops=2e5, slowdowns=CHAOS, execution=execution, val_interval=6, **FIT, **kw)
    return t.record, model


def test_the_same_seed_gives_the_same_slowdowns_and_bits_across_runs_and_executions():
    a, model_a = _diloco()
    assert a.slowdowns and any("slowed_s" in c for c in a.sim_time_per_node)
    b, model_b = _diloco()
    assert a.slowdowns == b.slowdowns and a.sim_time_per_node == b.sim_time_per_node
    assert all(torch.equal(x, y) for x, y in zip(model_a.parameters(), model_b.parameters()))
    fused, model_f = _diloco(execution="fused")  # parameters to float rounding, as for every strategy; time exactly
    assert fused.slowdowns == a.slowdowns and fused.sim_time_per_node == a.sim_time_per_node
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(model_a.parameters(), model_f.parameters()))


def test_a_resumed_run_meets_the_same_slowdowns(tmp_path):
    full, model = _diloco(checkpoint_interval=6, checkpoint_dir=tmp_path / "a")
    resumed, model_r = _diloco(checkpoint_interval=6, checkpoint_dir=tmp_path / "b",
                               resume_from=tmp_path / "a" / "step_000000006")
    assert resumed.slowdowns == full.slowdowns and resumed.sim_time_per_node == full.sim_time_per_node
    assert resumed.node_loss == full.node_loss
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), model_r.parameters()))


def test_an_asynchronous_run_resumes_with_the_same_slowdowns(tmp_path):
    def run(**kw):
        t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
        model = t.fit(AsyncDiLoCoStrategy(H=3, lr=1e-2), 3, max_steps=10, node_speeds=[1.0, 0.6, 0.3],
                      network="home", device_flops=2e5, slowdowns=CHAOS, val_interval=5, checkpoint_interval=5, **FIT,
                      **kw)
        return t.record, model
    full, model = run(checkpoint_dir=tmp_path / "a")
    resumed, model_r = run(checkpoint_dir=tmp_path / "b", resume_from=tmp_path / "a" / "step_000000005")
    assert full.slowdowns and resumed.slowdowns == full.slowdowns
    assert resumed.updates == full.updates and resumed.sim_time_per_node == full.sim_time_per_node
    assert all(torch.equal(x, y) for x, y in zip(model.parameters(), model_r.parameters()))


def test_the_run_folder_and_config_hold_the_slowdowns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = Trainer(replay.Pull(), replay.data())
    t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.25)), 2, max_steps=3, batch_size=B,
          device_flops=replay.flops_per_step(B), network=Network(bandwidth="inf", latency=0.0),
          slowdowns=[(1, 0.5, 2.5, 2.0)], progress=False, device="cpu", logger=True, run_name="chaos")
    folder = tmp_path / "logs" / "chaos"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["slowdowns"] == [{"node": 1, "from_s": 0.5, "to_s": 2.5, "factor": 2.0}]
    assert summary["sim_time_per_node"][1]["slowed_s"] == 1.0
    config = json.loads((folder / "config.json").read_text())
    assert config["time_model"]["slowdowns"] == "[(1, 0.5, 2.5, 2.0)]"


def test_a_window_past_the_drawn_ones_draws_on_and_long_compute_spans_several():
    s = SlowdownSchedule(1, drawn=RandomSlowdowns(rate=1.0, factor=2.0, duration=1.0, seed=0))
    # 100 s of work from 0: every window met is drawn, and the compute is stretched by half of each window's length
    took = s.stretch(0, 0.0, 100.0)
    met = s.during(0, took)
    assert len(met) > 10 and math.isclose(took, 100.0 + 0.5 * sum(w.to_s - w.from_s for w in met), rel_tol=1e-9)


def test_a_step_spanning_more_windows_than_the_bound_is_refused_and_the_bound_is_accepted():
    # Issue 46: rate=1e6 against a step of 1e9 simulated seconds drew windows without bound (2.65 GB, no end).
    s = SlowdownSchedule(1, drawn=RandomSlowdowns(rate=1e6, duration=1e-7))
    with pytest.raises(ValueError, match=r"one step of node 0 .* spans more than 10,000 slowdown windows"):
        s.stretch(0, 0.0, 1e9)
    # A step spanning a few thousand windows is fine: the same rate, a step 1,000 times shorter (each window
    # starts after an exponential gap of mean 1 us and lasts 0.1 us)
    s = SlowdownSchedule(1, drawn=RandomSlowdowns(rate=1e6, duration=1e-7, factor=2.0))
    took = s.stretch(0, 0.0, 1e-3)
    assert 1e-3 < took < 1.2e-3


@pytest.mark.parametrize("spec, message", [
    (dict(rate=-0.1), "rate must be >= 0"), (dict(rate=1.0, factor=0.5), "factor must be >= 1"),
    (dict(rate=1.0, duration=0.0), "duration must be > 0"), (dict(rate=1.0, seed=-1), "seed must be >= 0"),
    (dict(rate=float("inf")), "finite"), (dict(rate=1.0, factor=(3.0, 2.0)), "low <= high"),
    (dict(rate=1.0, duration=(1.0, 2.0, 3.0)), "a number or a \\(low, high\\) range")])
def test_bad_random_slowdowns_are_refused(spec, message):
    with pytest.raises((ValueError, TypeError), match=message):
        RandomSlowdowns(**spec)


def test_the_boundary_values_are_accepted():
    RandomSlowdowns(rate=0.0, factor=1.0, duration=(1e-9, 1e-9), seed=0)
    assert build_slowdowns(2, [(1, 0.0, 1.0, 1.0), (1, 1.0, 2.0, 3.0)]) is not None  # touching windows: fine


@pytest.mark.parametrize("slowdowns, message", [
    ([(2, 0.0, 1.0, 2.0)], "names node 2, but there are only 2 nodes"),
    ([(0, 1.0, 1.0, 2.0)], "must end after it starts"), ([(0, 0.0, 1.0, 0.9)], "factor must be >= 1"),
    ([(0, -1.0, 1.0, 2.0)], "from_s must be >= 0"), ([(0, 0.0, 2.0, 2.0), (0, 1.0, 3.0, 2.0)], "overlap"),
    ([(0, 0.0, 1.0)], r"\(node, from_s, to_s, factor\)"), ("chaos", "must be a list")])
def test_bad_windows_are_refused_before_any_node_starts(slowdowns, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, TypeError), match=message):
        _ddp(slowdowns)
    assert not (tmp_path / "logs").exists()


@pytest.mark.spawns
def test_the_same_slowdowns_over_two_processes():
    one, _ = _diloco()
    two, _ = _diloco(processes=2)
    assert two.slowdowns == one.slowdowns and two.sim_time_per_node == one.sim_time_per_node


@pytest.mark.spawns
def test_on_the_torch_backend_a_synchronous_strategy_meets_the_same_slowdowns_at_the_same_simulated_times():
    # The torch backend settles each collective's clocks by the sim's rule (exogym.backends.torch.transport), and
    # each node stretches its own compute by the same seeded schedule: same windows, same simulated times.
    sim, model = _diloco()
    torch_, model_t = _diloco(backend="torch")
    assert sim.slowdowns and torch_.slowdowns == sim.slowdowns
    assert torch_.sim_time_per_node == sim.sim_time_per_node and any("slowed_s" in c for c in sim.sim_time_per_node)
    assert [r["sim_time_s"] for r in torch_.train] == [r["sim_time_s"] for r in sim.train]
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(model.parameters(), model_t.parameters()))


def test_on_the_torch_backend_a_strategy_that_sends_messages_refuses_slowdowns_before_any_node_starts(tmp_path,
                                                                                                      monkeypatch):
    # Its messages, server and time budget run on the wall clock there: simulated slowdowns would change nothing
    # the server applies while the record listed them.
    monkeypatch.chdir(tmp_path)
    t = Trainer(replay.Pull(), replay.data())
    with pytest.raises(ValueError, match="slowdowns= cannot slow AsyncDiLoCoStrategy on backend='torch'"):
        t.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2), 3, max_steps=4, backend="torch",
              slowdowns=[(0, 0.0, 4.0, 2.0)], logger=True, run_name="refused",
              **{k: v for k, v in FIT.items() if k != "logger"})
    assert not (tmp_path / "logs").exists()
    with pytest.raises(ValueError, match="node_speeds= cannot slow AsyncDiLoCoStrategy on backend='torch'"):
        t.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2), 3, max_steps=4, backend="torch",
              node_speeds=[1.0, 0.5, 0.25], **FIT)


def test_the_command_line_draws_slowdowns_from_its_seed(tmp_path, monkeypatch):
    from exogym.cli.commands import main
    monkeypatch.chdir(tmp_path)
    # the synthetic task's MLP at 1e12 FLOP/s: 20 steps take under 2 simulated microseconds, hence these numbers
    assert main(["run", "--task", "synthetic", "--nodes", "2", "--steps", "20", "--val-size", "16", "--quiet",
                 "--slowdown-rate", "2e6", "--slowdown-factor", "3", "--slowdown-duration", "2e-7",
                 "--run-name", "chaos"]) == 0
    summary = json.loads((tmp_path / "logs" / "chaos" / "summary.json").read_text())
    assert summary["slowdowns"] and {w["factor"] for w in summary["slowdowns"]} == {3.0}
    config = json.loads((tmp_path / "logs" / "chaos" / "config.json").read_text())
    assert config["time_model"]["slowdowns"] == "RandomSlowdowns(rate=2000000.0, factor=3.0, duration=2e-07, seed=0)"
