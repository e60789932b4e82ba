"""DiLoCo pinned on hand-derived trajectories, its schedule, its bytes, and dropped outer gradients."""

import torch
from torch.testing import assert_close

from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import DiLoCoStrategy, OptimSpec
from strategy_toys import NODES, flat, node_params, run_linear, watched

GRADS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]]  # node r's constant gradient
INIT = [1.0, 2.0, 3.0]
ETA, H, OUTER_LR, MU = 0.1, 3, 0.7, 0.9


def diloco(**kwargs):
    return watched(DiLoCoStrategy)(OptimSpec(torch.optim.SGD, lr=ETA), H=H, **kwargs)


def nesterov_reference(rounds: int) -> torch.Tensor:
    """theta after `rounds` rounds, derived by hand. Each node moves H*eta*c_r from the global model, so the
    averaged pseudo-gradient is the same every round: d = H*eta*mean(c). torch's Nesterov SGD keeps
    b_n = mu b_{n-1} + d (b_1 = d) and steps by d + mu b_n = d (1 + mu + ... + mu^n): after R rounds
    theta_R = theta_0 - lr d sum_{n=1..R} sum_{j=0..n} mu^j."""
    d = H * ETA * torch.tensor(GRADS).mean(0)
    factor = sum(sum(MU ** j for j in range(n + 1)) for n in range(1, rounds + 1))
    return torch.tensor(INIT) - OUTER_LR * factor * d


def test_nesterov_outer_step_follows_the_hand_derived_trajectory():
    for rounds in (1, 3):
        model, _ = run_linear(diloco(outer_lr=OUTER_LR, outer_momentum=MU, nesterov=True), GRADS, INIT, rounds * H)
        expected = nesterov_reference(rounds)
        assert_close(flat(model), expected, rtol=1e-5, atol=1e-6)  # fit returns the outer (global) model
        for r in range(2):
            assert_close(node_params(r), expected, rtol=1e-5, atol=1e-6)  # every node starts from it


def test_mid_round_nodes_hold_local_progress_and_the_global_model_is_the_outer_one():
    # final_sync=False: the run ends mid-round without a last round (the defaults: outer lr 0.7, Nesterov 0.9)
    model, _ = run_linear(diloco(final_sync=False), GRADS, INIT, 2 * H + 1)
    theta = nesterov_reference(2)
    assert_close(flat(model), theta, rtol=1e-5, atol=1e-6)
    for r in range(2):
        assert_close(node_params(r), theta - ETA * torch.tensor(GRADS[r]), rtol=1e-5, atol=1e-6)


def test_first_sync_after_exactly_h_steps_with_one_all_reduce_of_the_model():
    grads = GRADS + [[0.0, 1.0, 1.0]]  # 3 nodes, so (K-1)/K is not 1/2
    _, t = run_linear(diloco(final_sync=False), grads, INIT, H - 1)
    assert t.record.bytes_per_node == [0, 0, 0]
    _, t = run_linear(diloco(), grads, INIT, H)
    model_bytes = 3 * 4
    assert t.record.bytes_per_node == [all_reduce_bytes(model_bytes, 3)] * 3 == [2 * model_bytes * 2 // 3] * 3
    assert t.record.comm_per_node[0]["calls_by_op"] == {"all_reduce": 1}  # no broadcast of parameters
    _, t = run_linear(diloco(final_sync=False), grads, INIT, 4 * H + 2)
    assert t.record.bytes_per_node == [4 * 2 * model_bytes * 2 // 3] * 3
    per_step = [row["bytes"] for row in t.record.train]  # per node, cumulative
    assert [b for b, prev in zip(per_step, [0] + per_step) if b != prev] == per_step[H - 1::H][:4]


def test_dropped_pseudo_gradients_are_left_out_and_their_node_keeps_its_parameters():
    grads = GRADS + [[-1.0, 1.0, 2.0]]
    rounds = 6
    model, _ = run_linear(diloco(outer_lr=1.0, outer_momentum=0.0, drop_prob=0.4, seed=1), grads, INIT, rounds * H)
    module = NODES[0][1].modules[0]
    kept = [module.kept_nodes(i) for i in range(rounds)]
    assert any(len(k) < 3 for k in kept) and any(len(k) == 3 for k in kept), kept  # the seed exercises both
    # Reference: plain outer SGD at lr 1 over the pseudo-gradients that arrived.
    c = torch.tensor(grads)
    master, local = torch.tensor(INIT), [torch.tensor(INIT) for _ in grads]
    for k in kept:
        local = [x - H * ETA * c[r] for r, x in enumerate(local)]
        if k:
            master = master - torch.stack([master - local[r] for r in k]).mean(0)
            for r in k:
                local[r] = master.clone()
    assert_close(flat(model), master, rtol=1e-5, atol=1e-6)
    for r in range(3):
        assert_close(node_params(r), local[r], rtol=1e-5, atol=1e-6)


def test_outer_optimizer_spellings():
    s = DiLoCoStrategy(inner_optim="adamw", outer_optim="sgd", H=100, lr=3e-4)
    assert s.optim_spec == OptimSpec(torch.optim.AdamW, lr=3e-4)
    assert s.modules[0].outer_optim_spec == OptimSpec(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    s = DiLoCoStrategy(outer_optim_spec=OptimSpec(torch.optim.Adam, lr=0.1), inner_lr=1e-3)
    assert s.modules[0].outer_optim_spec == OptimSpec(torch.optim.Adam, lr=0.1)
    assert s.optim_spec.kwargs["lr"] == 1e-3
    normalized = DiLoCoStrategy(outer_optim="sgd_normalized", outer_lr=0.5, outer_momentum=0.0).modules[0]
    assert normalized.normalize and normalized.outer_optim_spec == OptimSpec(torch.optim.SGD, lr=0.5, momentum=0.0,
                                                                               nesterov=False)


def test_sgd_normalized_moves_the_global_model_by_outer_lr_per_round():
    model, _ = run_linear(diloco(outer_optim="sgd_normalized", outer_lr=0.5, outer_momentum=0.0), GRADS, INIT, 2 * H)
    d = torch.tensor(GRADS).mean(0)
    assert_close(flat(model), torch.tensor(INIT) - 2 * 0.5 * d / d.norm(), rtol=1e-5, atol=1e-6)
