"""Failures and elastic pools: who is up at each step, and what the strategies do about it."""

from __future__ import annotations

import pytest
import torch

from exogym import RandomFailures, Trainer
from exogym.cluster.membership import build_membership
from exogym.strategy import (AveragingCommunicator, CommunicateOptimizeStrategy, DeMoStrategy, DiLoCoStrategy,
                             FedAvgStrategy, SimpleReduceStrategy, SPARTADiLoCoStrategy, SPARTAStrategy,
                             StreamingDiLoCoStrategy)
from exogym.comm.collectives import alive_ranks, get_rank
from toy import REGISTRY, LocalOnly, TinyMLP, make_classification, params

FIT = dict(batch_size=8, progress=False, logger=False, val_interval=100)


def _trainer() -> Trainer:
    return Trainer(TinyMLP(), make_classification(512), make_classification(64, seed=1))


# ---- the schedule --------------------------------------------------------------------------------
def test_failure_intervals_and_joiners():
    m = build_membership(3, 10, failures=[(1, 3, 6), (2, 8, None)])
    assert [m.alive(t) for t in (1, 2, 3, 5, 6, 7, 8, 10)] == [(0, 1, 2), (0, 1, 2), (0, 2), (0, 2), (0, 1, 2),
                                                            (0, 1, 2), (0, 1), (0, 1)]
    assert m.joiners(6) == (1,) and m.survivors(6) == (0, 2)
    assert m.joiners(1) == () and m.joiners(3) == () and m.joiners(8) == ()
    assert build_membership(3, 10) is None


def test_elastic_presets_follow_the_diloco_paper_pools():
    sizes = {name: [len(build_membership(4, 8, active_nodes=name).alive(t)) for t in range(1, 9)]
             for name in ("doubling", "halving", "ramp_up", "ramp_down")}
    assert sizes == {"doubling": [2, 2, 2, 2, 4, 4, 4, 4], "halving": [4, 4, 4, 4, 2, 2, 2, 2],
                     "ramp_up": [1, 1, 2, 2, 3, 3, 4, 4], "ramp_down": [4, 4, 3, 3, 2, 2, 1, 1]}
    m = build_membership(4, 10, active_nodes=[(1, 1), (4, 3)], failures=[(0, 6, 8)])
    assert [m.alive(t) for t in (1, 4, 6, 8)] == [(0,), (0, 1, 2), (1, 2), (0, 1, 2)]
    assert build_membership(4, 6, active_nodes=lambda t: 1 + t % 2).alive(3) == (0, 1)


def test_random_failures_are_reproducible_and_always_leave_someone_up():
    a = build_membership(4, 300, failures=RandomFailures(0.2, downtime=5, seed=3))
    b = build_membership(4, 300, failures=RandomFailures(0.2, downtime=5, seed=3))
    c = build_membership(4, 300, failures=RandomFailures(0.2, downtime=5, seed=4))
    assert a == b and a != c
    for t in range(2, 301):
        assert a.alive(t) and set(a.alive(t)) & set(a.alive(t - 1))
    assert len(a.starts) > 10  # failures did happen


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(failures=[(3, 2, 4)]), ValueError, "only 3 nodes"),
    (dict(failures=[(0, 0, 4)]), ValueError, "step_down must be >= 1"),
    (dict(failures=[(0, 4, 4)]), ValueError, "step_up must be >= 5"),
    (dict(failures=[(0, 11, None)]), ValueError, "after the run's last step"),
    (dict(failures=[(0, 2, 6), (0, 5, 8)]), ValueError, "overlaps"),
    (dict(failures=[(0, 2)]), TypeError, "node, step_down, step_up"),
    (dict(failures="node 1"), TypeError, "list of"),
    (dict(failures=[(0, 2, 5), (1, 2, 5), (2, 3, 4)]), ValueError, "no node is up at step 3"),
    (dict(failures=[(0, 1, 5), (1, 5, None), (2, 5, None)]), ValueError, "no node is left to hand them"),
    (dict(active_nodes="tripling"), ValueError, "doubling"),
    (dict(active_nodes=[(2, 1)]), ValueError, "start at step 1"),
    (dict(active_nodes=[(1, 4)]), ValueError, "int in 1..3"),
    (dict(active_nodes=lambda t: 0), ValueError, "int in 1..3"),
    (dict(active_nodes=3), TypeError, "active_nodes must be"),
])
def test_bad_schedules_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        build_membership(3, 10, **kwargs)


def test_bad_rates():
    with pytest.raises(ValueError, match="rate must be <= 1"):
        RandomFailures(1.5)
    with pytest.raises(ValueError, match="downtime must be >= 1"):
        RandomFailures(0.1, downtime=0)


def test_fit_rejects_schedules_before_any_node_starts():
    trainer = _trainer()
    before = params(trainer.model)
    with pytest.raises(ValueError, match="only 4 nodes"):
        trainer.fit(SimpleReduceStrategy(), 4, max_steps=5, failures=[(4, 2, 3)], **FIT)
    with pytest.raises(ValueError, match="backend='sim'"):
        trainer.fit(SimpleReduceStrategy(), 2, max_steps=5, failures=[(1, 2, 3)], backend="torch", **FIT)
    with pytest.raises(ValueError, match="StreamingDiLoCoStrategy cannot run with failures"):
        trainer.fit(StreamingDiLoCoStrategy(H=4, num_fragments=2), 2, max_steps=8, active_nodes="doubling", **FIT)
    assert all(torch.equal(a, b) for a, b in zip(before, params(trainer.model)))


# ---- what the nodes do -----------------------------------------------------------------------------
class _Probe:
    """Mixed into a strategy: records per step and rank who was up, the model at the start of the step ("start")
    and after it ("probe")."""

    def step(self):
        REGISTRY[("start", self.local_step + 1, get_rank())] = params(self.model)
        super().step()
        REGISTRY[("probe", self.local_step, get_rank())] = (alive_ranks(), params(self.model))


class ProbeDDP(_Probe, SimpleReduceStrategy):
    def step(self):  # the gradients after averaging, too
        super().step()
        REGISTRY[("grads", self.local_step, get_rank())] = [p.grad.clone() for p in self.model.parameters()]


class ProbeFedAvg(_Probe, FedAvgStrategy):
    pass


class ProbeDiLoCo(_Probe, DiLoCoStrategy):
    def step(self):
        super().step()
        REGISTRY[("master", self.local_step, get_rank())] = [g.detach().clone() for g in self.modules[0].master]


def test_ddp_averages_over_the_nodes_up_and_a_joiner_comes_back_identical():
    REGISTRY.clear()
    trainer = _trainer()
    trainer.fit(ProbeDDP(lr=0.01), 3, max_steps=12, failures=[(1, 4, 8)], **FIT)
    for step in range(1, 13):
        up = [0, 2] if 4 <= step < 8 else [0, 1, 2]
        seen = {r for (tag, s, r) in REGISTRY if tag == "probe" and s == step}
        assert seen == set(up)  # a node that is down does not step
        assert all(REGISTRY[("probe", step, r)][0] == up for r in up)
        models = [REGISTRY[("probe", step, r)][1] for r in up]
        assert all(torch.equal(a, b) for m in models[1:] for a, b in zip(models[0], m))  # DDP: identical replicas
    rec = trainer.record
    assert all(row["step"] for row in rec.train)
    assert [row.get("loss") is None for row in _node_rows(trainer, 1)][3:7] == [True] * 4
    assert rec.bytes_per_node[1] < rec.bytes_per_node[2] < rec.bytes_per_node[0]  # node 0 sent node 1 the state


def test_ddp_gradient_is_the_mean_over_survivors_only():
    REGISTRY.clear()

    class Grads(ProbeDDP):
        def step(self):
            REGISTRY[("before", self.local_step + 1, get_rank())] = [p.grad.clone() for p in self.model.parameters()]
            super().step()

    _trainer().fit(Grads(lr=0.01), 3, max_steps=6, failures=[(2, 3, None)], **FIT)
    for step, up in ((2, [0, 1, 2]), (4, [0, 1])):
        mean = [sum(gs) / len(up) for gs in zip(*(REGISTRY[("before", step, r)] for r in up))]
        for got, want in zip(REGISTRY[("grads", step, 0)], mean):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_fedavg_joiner_starts_from_the_survivors_average():
    REGISTRY.clear()
    _trainer().fit(ProbeFedAvg(H=2, lr=0.1), 3, max_steps=9, failures=[(1, 3, 6)], **FIT)
    # node 1 comes up at step 6, mid-round, with the average of the survivors' models after step 5
    survivors_avg = [(a + b) / 2 for a, b in zip(REGISTRY[("probe", 5, 0)][1], REGISTRY[("probe", 5, 2)][1])]
    for got, want in zip(REGISTRY[("start", 6, 1)], survivors_avg):
        torch.testing.assert_close(got, want)
    stale = REGISTRY[("probe", 2, 1)][1]  # what it held when it went down
    assert not all(torch.allclose(a, b) for a, b in zip(REGISTRY[("start", 6, 1)], stale))
    for step in (2, 4, 6, 8):  # after each round, every node up holds the same average
        up = [0, 2] if 3 <= step < 6 else [0, 1, 2]
        assert REGISTRY[("probe", step, up[0])][0] == up
        models = [REGISTRY[("probe", step, r)][1] for r in up]
        assert all(torch.allclose(a, b) for m in models[1:] for a, b in zip(models[0], m))


def test_diloco_joiner_resets_to_the_global_model_and_rounds_exclude_the_failed_node():
    REGISTRY.clear()
    trainer = _trainer()
    model = trainer.fit(ProbeDiLoCo(H=3, lr=0.01), 3, max_steps=12, failures=[(2, 2, 7)], **FIT)
    for step in range(1, 13):
        up = [0, 1] if 2 <= step < 7 else [0, 1, 2]
        masters = [REGISTRY[("master", step, r)] for r in up]
        assert all(torch.equal(a, b) for m in masters[1:] for a, b in zip(masters[0], m))  # one global model
    # node 2 came up at step 7 holding the global model of round 2 (after step 6), not its stale weights
    for got, want in zip(REGISTRY[("start", 7, 2)], REGISTRY[("master", 6, 0)]):
        assert torch.equal(got, want)
    assert not all(torch.equal(a, b) for a, b in zip(REGISTRY[("start", 7, 2)], REGISTRY[("probe", 1, 2)][1]))
    # the returned model is the global model
    for got, want in zip(model.parameters(), REGISTRY[("master", 12, 0)]):
        assert torch.equal(got.detach(), want)


def test_global_model_excludes_nodes_that_are_down_even_node_0():
    REGISTRY.clear()
    trainer = _trainer()
    final = trainer.fit(LocalOnly(lr=0.1, tag="local"), 3, max_steps=6, failures=[(0, 4, None)], **FIT)
    want = [(a + b) / 2 for a, b in zip(params(REGISTRY[("local", 1)]), params(REGISTRY[("local", 2)]))]
    for got, w in zip(final.parameters(), want):
        torch.testing.assert_close(got.detach(), w)
    REGISTRY.clear()
    final = trainer.fit(ProbeDiLoCo(H=2, lr=0.01), 2, max_steps=6, failures=[(0, 5, None)], **FIT)
    for got, want in zip(final.parameters(), REGISTRY[("master", 6, 1)]):
        assert torch.equal(got.detach(), want)  # from node 1, the one up, not node 0's stale copy


def test_with_node_0_down_mid_round_the_global_validation_is_the_outer_model():
    # DiLoCo, H=4, node 0 down for steps 2..6: at step 3 no outer step has happened, so the global model is the
    # initial one and its validation loss is step 0's, bit for bit (node 1 sends its outer copy, not its inner model)
    t = Trainer(TinyMLP(), make_classification(256), make_classification(64, seed=1))
    t.fit(DiLoCoStrategy(H=4), 3, max_steps=8, failures=[(0, 2, 7)], **{**FIT, "val_interval": 3})
    rows = {r["step"]: r["global_loss"] for r in t.record.val}
    assert rows[3] == rows[0]


@pytest.mark.parametrize("make", [
    lambda: SimpleReduceStrategy(lr=0.01),
    lambda: DiLoCoStrategy(H=4, lr=0.01),
    lambda: DiLoCoStrategy(H=4, lr=0.01, quantization_bits=8),
    lambda: FedAvgStrategy(H=2, lr=0.1, client_sampling=0.5),
    lambda: FedAvgStrategy(H=2, lr=0.1, island_size=2),
    lambda: SPARTAStrategy(lr=0.01, p_sparta=0.1, async_delay=2),
    lambda: SPARTAStrategy(lr=0.01, p_sparta=0.1, compression_method="topk"),
    lambda: SPARTADiLoCoStrategy(lr=0.01, p_sparta=0.1, H=4),
    lambda: CommunicateOptimizeStrategy([AveragingCommunicator(2, quantization_bits=8)], lr=0.01),
    lambda: DeMoStrategy(lr=0.01),
    lambda: LocalOnly(lr=0.1),
], ids=["ddp", "diloco", "diloco-int8", "fedavg-sampling", "fedavg-islands", "sparta-async", "sparta-topk",
        "sparta-diloco", "averaging-int8", "demo", "custom"])
def test_every_strategy_runs_through_failures_and_an_elastic_pool(make):
    trainer = _trainer()
    trainer.fit(make(), 4, max_steps=24, active_nodes="ramp_up", failures=[(0, 10, 14), (3, 20, None)],
                diagnostics_interval=6, **FIT)
    assert len(trainer.record.train) == 24 and trainer.record.val
    m = build_membership(4, 24, active_nodes="ramp_up", failures=[(0, 10, 14), (3, 20, None)])
    assert trainer.record.column("nodes_up") == [len(m.alive(t)) for t in range(1, 25)]
    assert all(row["loss"] == row["loss"] for row in trainer.record.train)  # someone computed every step
    assert trainer.record.config["membership"]["schedule"][0] == {"from_step": 1, "nodes_up": [0]}


def test_demo_joiner_starts_with_an_empty_momentum_and_the_survivors_model():
    REGISTRY.clear()

    class ProbeDeMo(_Probe, DeMoStrategy):
        def step(self):
            if self.local_step + 1 == 6 and get_rank() == 1:  # just after coming up, before its own gradient
                REGISTRY["momentum"] = [s["momentum"].clone() for s in self.optim.state.values()]
            super().step()

    _trainer().fit(ProbeDeMo(lr=0.01), 3, max_steps=8, failures=[(1, 3, 6)], **FIT)
    assert REGISTRY["momentum"] and all(not m.any() for m in REGISTRY["momentum"])
    for got, want in zip(REGISTRY[("start", 6, 1)], REGISTRY[("probe", 5, 0)][1]):
        assert torch.equal(got, want)  # every replica is the same: a survivor's model, not an average
    for step in (6, 7, 8):
        models = [REGISTRY[("probe", step, r)][1] for r in range(3)]
        assert all(torch.equal(a, b) for m in models[1:] for a, b in zip(models[0], m))


def test_joiner_clock_catches_up_with_the_cluster():
    trainer = _trainer()
    trainer.fit(SimpleReduceStrategy(lr=0.01), 3, max_steps=10, failures=[(1, 3, 6)], network="low", **FIT)
    clocks = trainer.record.sim_time_per_node
    assert clocks[0]["now"] == clocks[1]["now"] == clocks[2]["now"]  # DDP: everyone leaves the last step together
    assert clocks[1]["compute_s"] < clocks[0]["compute_s"]  # it computed 3 steps fewer


def test_a_run_with_failures_is_reproducible_and_resumes_exactly(tmp_path):
    kwargs = dict(max_steps=12, failures=[(1, 3, 7)], active_nodes=[(1, 2), (5, 3)], **FIT)
    a = _trainer().fit(DiLoCoStrategy(H=3, lr=0.01), 3, **kwargs)
    b = _trainer().fit(DiLoCoStrategy(H=3, lr=0.01), 3, checkpoint_interval=4, checkpoint_dir=tmp_path, **kwargs)
    t = _trainer()
    c = t.fit(DiLoCoStrategy(H=3, lr=0.01), 3, resume_from=tmp_path / "step_000000004", **kwargs)
    for x, y, z in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y) and torch.equal(x, z)


def _node_rows(trainer: Trainer, rank: int) -> list[dict]:
    return [{"loss": None if loss != loss else loss} for loss in trainer.record.node_loss[rank]]

