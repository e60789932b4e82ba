"""DGC: selection, masking, accumulation and the averaged update by hand; full sending vs DDP; bytes; resume;
the original EXO Gym script's call; argument checks."""

import math

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import DGCStrategy, OptimSpec, SimpleReduceStrategy
from strategy_toys import FIT, NODES, Linear, constant_gradients, node_params, run_linear, watched

GRADS = [[3.0, 1.0, -2.0, 0.0], [1.0, -4.0, 0.0, 2.0]]


def test_two_nodes_hand_derived_trajectory():
    # m = 0.5, 1 of 4 entries sent per node per step (k = ceil(0.25 * 4)), SGD lr 0.1, no clipping, no warm-up.
    # Step 1: u = v = g. Node 0 sends entry 0 (3), node 1 entry 1 (-4): average [1.5, -2, 0, 0].
    #   Masking: node 0 u = v = [0, 1, -2, 0]; node 1 u = v = [1, 0, 0, 2].
    # Step 2: node 0 u = 0.5 [0, 1, -2, 0] + g0 = [3, 1.5, -3, 0], v = [0, 1, -2, 0] + u = [3, 2.5, -5, 0]: sends
    #   entry 2 (-5). Node 1 u = [1.5, -4, 0, 3], v = [2.5, -4, 0, 5]: sends entry 3 (5). Average [0, 0, -2.5, 2.5].
    #   Masking: node 0 u = [3, 1.5, 0, 0], v = [3, 2.5, 0, 0]; node 1 u = [1.5, -4, 0, 0], v = [2.5, -4, 0, 0].
    # Step 3: node 0 u = [4.5, 1.75, -2, 0], v = [7.5, 4.25, -2, 0]: sends entry 0 (7.5). Node 1 u = [1.75, -6, 0, 2],
    #   v = [4.25, -10, 0, 2]: sends entry 1 (-10). Average [3.75, -5, 0, 0].
    # w = -0.1 ([1.5, -2, 0, 0] + [0, 0, -2.5, 2.5] + [3.75, -5, 0, 0]) = [-0.525, 0.7, 0.25, -0.25].
    strategy = watched(DGCStrategy)(OptimSpec(torch.optim.SGD, lr=0.1), target_sparsity=0.25, momentum=0.5)
    model, t = run_linear(strategy, GRADS, [0.0] * 4, 3)
    w = torch.tensor([-0.525, 0.7, 0.25, -0.25])
    assert_close(model.w.detach(), w)
    for r, u, v in ((0, [0, 1.75, -2, 0], [0, 4.25, -2, 0]), (1, [1.75, 0, 0, 2], [4.25, 0, 0, 2])):
        assert_close(node_params(r), w)
        s = NODES[r][1]
        assert_close(s.u[0], torch.tensor(u, dtype=torch.float32))
        assert_close(s.v[0], torch.tensor(v, dtype=torch.float32))
        assert s.optim.param_groups[0]["momentum"] == 0.0  # the momentum lives in u only
    assert t.record.bytes_per_node == [3 * 1 * 1 * (4 + 4)] * 2  # K-1 = 1, k = 1: int32 index + fp32 value


def test_sending_everything_is_ddp_with_plain_sgd_because_masking_clears_the_momentum():
    # target_sparsity=1: every entry is sent, so masking zeroes all of u and v after each step: u = m 0 + g = g,
    # v = 0 + u = g, the update is the mean of g, and SGD (momentum 0) steps with it: DDP with SGD *without*
    # momentum, whatever m is. (Momentum correction equals momentum SGD only for entries that are not sent.)
    grads = [[3.0, 1.0, -2.0, 0.5], [1.0, -4.0, 0.25, 2.0], [0.5, 0.5, 1.0, -1.0]]
    dgc, _ = run_linear(DGCStrategy(OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9), target_sparsity=1.0,
                                    momentum=0.9), grads, [0.1, 0.2, 0.3, 0.4], 5)
    ddp, _ = run_linear(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1)), grads, [0.1, 0.2, 0.3, 0.4], 5)
    ddp_momentum, _ = run_linear(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9)), grads,
                                 [0.1, 0.2, 0.3, 0.4], 5)
    assert_close(dgc.w.detach(), ddp.w.detach(), rtol=1e-6, atol=1e-7)
    mean = torch.tensor(grads).mean(0)
    assert_close(dgc.w.detach(), torch.tensor([0.1, 0.2, 0.3, 0.4]) - 5 * 0.1 * mean)
    assert not torch.allclose(dgc.w.detach(), ddp_momentum.w.detach())

    # On a real model, with the same data and seed, the same (to float rounding).
    def fit(strategy):
        return Trainer(toy.TinyMLP(), toy.make_classification(128)).fit(strategy, 2, batch_size=8, max_steps=6, **FIT)
    a = fit(DGCStrategy(OptimSpec(torch.optim.SGD, lr=0.05), target_sparsity=1.0, momentum=0.9))
    b = fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.05)))
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_warm_up_decays_the_fraction_sent_exponentially_from_a_quarter():
    s = DGCStrategy(target_sparsity=0.001, warmup_steps=4)
    assert [s.fraction_sent(t) for t in range(6)] == pytest.approx(
        [0.25, 0.25 * 0.004 ** 0.25, 0.25 * 0.004 ** 0.5, 0.25 * 0.004 ** 0.75, 0.001, 0.001])
    assert DGCStrategy(target_sparsity=0.5, warmup_steps=4).fraction_sent(0) == 0.5  # denser than 25%: no warm-up
    assert DGCStrategy(target_sparsity=0.001).fraction_sent(0) == 0.001
    assert [DGCStrategy.entries_sent(n, f) for n, f in ((1000, 0.001), (128, 0.001), (4, 0.25), (3, 1.0), (0, 1.0))] \
        == [1, 1, 1, 3, 0]


@pytest.mark.parametrize("warmup", [0, 3])
def test_bytes_per_step_follow_the_all_gather_formula(warmup):
    shapes = [(16, 8), (16,), (3, 16), (3,)]  # TinyMLP
    target, nodes, steps = 0.05, 3, 5
    s = DGCStrategy(OptimSpec(torch.optim.SGD, lr=0.05), target_sparsity=target, warmup_steps=warmup)
    expected = 0
    for t in range(steps):
        f = s.fraction_sent(t)
        k = [max(1, math.ceil(f * math.prod(shape))) for shape in shapes]
        expected += (nodes - 1) * sum(k) * (4 + 4)  # int32 index + float32 value, ring all-gather
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
    trainer.fit(s, nodes, batch_size=8, max_steps=steps, **FIT)
    assert trainer.record.bytes_per_node == [expected] * nodes
    assert trainer.record.comm_per_node[0]["calls_by_op"] == {"all_gather": 2 * steps}  # indices, values
    if warmup == 0:
        assert expected == steps * 2 * (7 + 1 + 3 + 1) * 8


def test_resume_from_a_checkpoint_is_bit_identical(tmp_path):
    def make():
        return DGCStrategy(OptimSpec(torch.optim.SGD, lr=0.05, momentum=0.9), target_sparsity=0.05, warmup_steps=6,
                           clip_threshold=1.0, momentum=0.9, lr_scheduler="lambda_cosine",
                           lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True}, max_norm=1.0)

    def trainer():
        return Trainer(toy.TinyMLP(hidden=16, dropout=0.2), toy.make_classification(96),
                       toy.make_classification(24, seed=1))

    toy.assert_resumes_bit_identically(make, trainer, tmp_path, **dict(FIT, batch_size=8, val_interval=5))


def test_the_original_image_train_call_trains():
    # example/image_train.py --strategy dgc of the original EXO Gym, with its defaults.
    from exogym.strategy.dgc import DGCStrategy as Imported
    optim = OptimSpec(torch.optim.SGD, lr=0.01, momentum=0.9)
    strategy = Imported(optim_spec=optim, target_sparsity=0.001, warmup_steps=500, clip_threshold=1.0, momentum=0.9,
                        lr_scheduler="lambda_cosine", lr_scheduler_kwargs={"warmup_steps": 1, "cosine_anneal": True},
                        max_norm=1.0)
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    model = trainer.fit(strategy, 2, batch_size=8, max_steps=3, **FIT)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.record.bytes_per_node[0] > 0


def test_a_node_coming_back_starts_with_empty_momentum_and_accumulator():
    strategy = watched(DGCStrategy)(OptimSpec(torch.optim.SGD, lr=0.1), target_sparsity=0.25, momentum=0.5)
    NODES.clear()
    trainer = Trainer(Linear([0.0] * 4), constant_gradients(GRADS))
    trainer.fit(strategy, 2, batch_size=4, max_steps=4, failures=[(1, 2, 3)], **FIT)
    # Setting of the hand-derived test; node 1 is down at step 2. Step 1 as there: average [1.5, -2, 0, 0].
    # Step 2, node 0 alone: sends entry 2 (-5) of v = [3, 2.5, -5, 0]; the update is [0, 0, -5, 0].
    # Step 3: node 1 comes back with u = v = 0 (not node 0's): u = v = g1, sends entry 1 (-4), keeps [1, 0, 0, 2];
    #   node 0 sends entry 0 (7.5) of v = [7.5, 4.25, -2, 0]: average [3.75, -2, 0, 0].
    # Step 4: node 0 u = [3, 1.875, -3, 0], v = [3, 6.125, -5, 0], sends entry 1; node 1 u = [1.5, -4, 0, 3],
    #   v = [2.5, -4, 0, 5], sends entry 3: average [0, 3.0625, 0, 2.5].
    w = -0.1 * torch.tensor([5.25, -0.9375, -5.0, 2.5])
    for r in (0, 1):
        assert_close(node_params(r), w)  # node 1 took a survivor's model and the same updates since
    assert_close(NODES[1][1].u[0], torch.tensor([1.5, -4.0, 0.0, 0.0]))
    assert_close(NODES[1][1].v[0], torch.tensor([2.5, -4.0, 0.0, 0.0]))
    assert_close(NODES[0][1].u[0], torch.tensor([3.0, 0.0, -3.0, 0.0]))
    assert trainer.record.bytes_per_node[1] == 3 * 8  # steps 1, 3 and 4


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(target_sparsity=0), ValueError, "target_sparsity must be > 0"),
    (dict(target_sparsity=1.5), ValueError, "target_sparsity must be <= 1"),
    (dict(target_sparsity="0.1"), TypeError, "target_sparsity must be a number"),
    (dict(warmup_steps=-1), ValueError, "warmup_steps must be >= 0"),
    (dict(warmup_steps=2.5), TypeError, "warmup_steps must be an int"),
    (dict(clip_threshold=0), ValueError, "clip_threshold must be > 0"),
    (dict(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    (dict(momentum=-0.1), ValueError, "momentum must be >= 0"),
    (dict(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.5), momentum=0.9), ValueError,
     "momentum=0.9, but optim_spec"),
    (dict(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True)), ValueError, "Nesterov"),
    (dict(optim_spec=OptimSpec(torch.optim.AdamW, lr=0.1)), TypeError, "with SGD"),
    (dict(bogus=1), TypeError, "bogus"),
])
def test_bad_arguments_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        DGCStrategy(**kwargs)


def test_a_spec_without_momentum_or_with_the_same_momentum_is_accepted():
    for spec in (OptimSpec(torch.optim.SGD, lr=0.1), OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9)):
        s = DGCStrategy(optim_spec=spec, momentum=0.9)
        assert s.optim_spec == OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.0)
