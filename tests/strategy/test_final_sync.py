"""DiLoCo-style strategies never throw training away: a run whose last step is not a round's last ends with one
more (shorter, counted) round, so the returned model includes every step; final_sync=False is the old rule."""

import pytest
import torch
from torch.testing import assert_close

from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import (DiLoCoStrategy, FedAvgStrategy, OptimSpec, SPARTADiLoCoStrategy,
                             StreamingDiLoCoStrategy)
from strategy_toys import flat, node_params, run_linear, watched

GRADS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]]  # node r's constant gradient
INIT = [1.0, 2.0, 3.0]
ETA, H, LR, MU = 0.1, 3, 0.7, 0.9
SGD = OptimSpec(torch.optim.SGD, lr=ETA)
MEAN = torch.tensor(GRADS).mean(0)


def nesterov(pseudo_gradients: list[torch.Tensor]) -> torch.Tensor:
    """theta after outer Nesterov steps on these averaged pseudo-gradients (torch's SGD rule, by hand)."""
    theta, b = torch.tensor(INIT), None
    for d in pseudo_gradients:
        b = d if b is None else MU * b + d
        theta = theta - LR * (d + MU * b)
    return theta


@pytest.mark.parametrize("steps", [2 * H + 1, H - 1])
def test_diloco_ends_with_a_short_round_that_includes_every_step(steps):
    model, t = run_linear(watched(DiLoCoStrategy)(SGD, H=H), GRADS, INIT, steps)
    full, rest = divmod(steps, H)
    expected = nesterov([H * ETA * MEAN] * full + [rest * ETA * MEAN])
    assert_close(flat(model), expected, rtol=1e-5, atol=1e-6)
    for r in range(2):
        assert_close(node_params(r), expected, rtol=1e-5, atol=1e-6)  # every node ends on the global model
    assert t.record.bytes_per_node == [(full + 1) * all_reduce_bytes(3 * 4, 2)] * 2  # the last round is counted
    assert not torch.equal(flat(model), torch.tensor(INIT))  # a run shorter than H trains too


def test_diloco_ending_on_a_round_sends_nothing_more():
    _, t = run_linear(DiLoCoStrategy(SGD, H=H), GRADS, INIT, 2 * H)
    assert t.record.comm_per_node[0]["calls_by_op"] == {"all_reduce": 2}


def test_final_sync_false_returns_the_last_full_rounds_model():
    model, t = run_linear(DiLoCoStrategy(SGD, H=H, final_sync=False), GRADS, INIT, H - 1)
    assert torch.equal(flat(model), torch.tensor(INIT)) and t.record.bytes_per_node == [0, 0]


def test_streaming_diloco_syncs_every_fragment_left_and_matches_diloco_with_one_fragment():
    steps = 2 * 4 + 2
    diloco, _ = run_linear(DiLoCoStrategy(SGD, H=4), GRADS, INIT, steps)
    streaming, _ = run_linear(StreamingDiLoCoStrategy(SGD, H=4, num_fragments=1, tau=0, alpha=0.0), GRADS, INIT,
                              steps)
    assert torch.equal(flat(streaming), flat(diloco))
    # Two fragments (the bias and the weight of a Linear are one layer: use a two-layer model below), tau=1:
    # the fragment sent at the last step is applied, the other one is synchronised once more.
    off, _ = run_linear(StreamingDiLoCoStrategy(SGD, H=4, num_fragments=1, tau=1, final_sync=False), GRADS, INIT,
                        steps)
    on, _ = run_linear(StreamingDiLoCoStrategy(SGD, H=4, num_fragments=1, tau=1), GRADS, INIT, steps)
    assert not torch.equal(flat(on), flat(off))


def test_sparta_diloco_ends_with_a_round_too():
    off, t_off = run_linear(SPARTADiLoCoStrategy(SGD, H=H, p_sparta=0.3, final_sync=False), GRADS, INIT, H + 1)
    on, t_on = run_linear(SPARTADiLoCoStrategy(SGD, H=H, p_sparta=0.3), GRADS, INIT, H + 1)
    assert t_on.record.bytes_per_node[0] - t_off.record.bytes_per_node[0] == all_reduce_bytes(3 * 4, 2)
    assert not torch.equal(flat(on), flat(off))


def test_fedavg_partial_last_round_is_in_the_returned_model():
    model, _ = run_linear(watched(FedAvgStrategy)(SGD, H=4), GRADS, INIT, 6)  # 2 steps after the last average
    assert_close(flat(model), (node_params(0) + node_params(1)) / 2, rtol=0, atol=1e-7)
    assert not torch.equal(node_params(0), node_params(1))
