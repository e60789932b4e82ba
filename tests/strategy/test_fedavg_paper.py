"""FedAvg as McMahan et al.'s Algorithm 1 on unequal shards: the average weighted by n_k / n, E n_k / B local steps
per round (a node that finishes early sits out the rest of the round), against step-by-step hand replays; and the
unweighted equal-steps variant. With client sampling and islands too."""

import math

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import FedAvgStrategy
from exogym.strategy.federated_averaging import AveragingCommunicator
from strategy_toys import FIT, NODES, Linear, node_params, watched

LR, B = 0.1, 4
SIZES = [8, 16, 12, 4, 20, 8]  # examples per node: 2, 4, 3, 1, 5, 2 batches of 4
GRADS = [[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 2.0], [-0.75, -1.0], [0.125, 4.0]]
INIT = [0.3, -0.2]


class MatmulLinear(Linear):
    """Linear with its inner product as a matmul, so the FLOP counter gives each step a compute time."""

    def forward(self, batch):
        (c,) = batch
        return (c.mean(0, keepdim=True) @ self.w.unsqueeze(1)).sum()


def unequal(rank, num_nodes, is_val):
    """Node r holds SIZES[r] copies of GRADS[r]: with Linear, every step's gradient is GRADS[r]."""
    return TensorDataset(torch.tensor([GRADS[rank]] * SIZES[rank], dtype=torch.float32))


def fit(steps, nodes, **kwargs):
    NODES.clear()
    trainer = Trainer(MatmulLinear(INIT), unequal)
    model = trainer.fit(watched(FedAvgStrategy)("sgd", lr=LR, **kwargs), nodes, batch_size=B, max_steps=steps,
                        device_flops=1e9, **FIT)
    return model, trainer.record


def replay(steps, nodes, *, local_steps, weighted, sampling=1.0, island_size=None, seed=0):
    """Plain SGD per node on its constant gradient, FedAvg's rounds by hand. Only who is drawn (participants,
    islands) comes from the module: the draw, not the algorithm."""
    draw = AveragingCommunicator(1, client_sampling=sampling, island_size=island_size, seed=seed)
    draw.num_nodes = nodes
    theta = [torch.tensor(INIT, dtype=torch.float64) for _ in range(nodes)]
    grads = [torch.tensor(g, dtype=torch.float64) for g in GRADS[:nodes]]
    computed = [[False] * steps for _ in range(nodes)]
    step, r = 0, 0
    while step < steps:
        members = draw.participants(r)
        length = max(local_steps[k] for k in members)
        for pos in range(1, length + 1):
            step += 1
            if step > steps:
                return theta, computed
            for k in members:
                if pos <= local_steps[k]:
                    theta[k] = theta[k] - LR * grads[k]
                    computed[k][step - 1] = True
        for island in draw.islands(r):
            w = [SIZES[k] if weighted else 1 for k in island]
            mean = sum(wk * theta[k] for wk, k in zip(w, island)) / sum(w)
            for k in island:
                theta[k] = mean
        upcoming = draw.participants(r + 1)
        for i, k in enumerate([k for k in upcoming if k not in members] if sampling < 1 else []):
            theta[k] = theta[members[i % len(members)]].clone()  # the hand-over from a node of this round
        r += 1
    return theta, computed


def check(record, nodes, theta, computed):
    for k in range(nodes):
        assert_close(node_params(k), theta[k].float(), rtol=1e-6, atol=1e-6)
        assert [not math.isnan(x) for x in record.node_loss[k]] == computed[k], k  # sat out = no forward


def test_paper_default_weights_by_n_k_and_runs_e_n_k_over_b_steps():
    E, K = 2, 3  # steps per round 4, 8, 6: the round is 8 steps; node 0 sits out 4 of them, node 2 two
    _, record = fit(16, K, local_epochs=E)
    theta, computed = replay(16, K, local_steps=[E * n // B for n in SIZES[:K]], weighted=True)
    check(record, K, theta, computed)
    assert sum(computed[0]) == 8 and sum(computed[1]) == 16 and sum(computed[2]) == 12
    assert record.bytes_per_node == [2 * all_reduce_bytes(8, K)] * K  # two rounds, the 2-float model, nothing more
    compute = [c["compute_s"] for c in record.sim_time_per_node]  # an idle node's clock does not count compute
    assert compute[0] / compute[1] == pytest.approx(0.5) and compute[2] / compute[1] == pytest.approx(0.75)
    uniform, _ = replay(16, K, local_steps=[E * n // B for n in SIZES[:K]], weighted=False)
    assert (uniform[0] - theta[0]).abs().max() > 1e-2  # the weighting is visible on these shards


def test_equal_steps_unweighted_variant_on_request():
    E, K = 1, 3
    _, record = fit(6, K, local_epochs=E, weight_by_shard_size=False, equal_local_steps=True)
    theta, computed = replay(6, K, local_steps=[E * min(SIZES[:K]) // B] * K, weighted=False)
    check(record, K, theta, computed)
    assert all(all(c) for c in computed)  # everyone trains every step: 2 per round


def test_fixed_h_rounds_are_weighted_too():
    K = 3
    _, record = fit(6, K, H=3)
    theta, computed = replay(6, K, local_steps=[3] * K, weighted=True)
    check(record, K, theta, computed)


def test_sampling_and_islands_follow_the_paper_per_island():
    E, K = 1, 6  # 4 of 6 sampled per round, islands of 2; round lengths vary with who is drawn
    kwargs = dict(local_epochs=E, client_sampling=4 / 6, island_size=2, seed=3)
    theta, computed = replay(20, K, local_steps=[E * n // B for n in SIZES], weighted=True, sampling=4 / 6,
                             island_size=2, seed=3)
    _, record = fit(20, K, **kwargs)
    check(record, K, theta, computed)
    lengths = {max(SIZES[k] // B for k in NODES[0][1].modules[0].participants(r)) for r in range(3)}
    assert len(lengths) > 1, lengths  # the rounds really differ in length here


def test_equal_shards_give_the_plain_mean_bit_for_bit():
    def equal(rank, num_nodes, is_val):
        return TensorDataset(torch.tensor([GRADS[rank]] * 8, dtype=torch.float32))
    finals = []
    for weighted in (True, False):
        NODES.clear()
        Trainer(Linear(INIT), equal).fit(watched(FedAvgStrategy)("sgd", lr=LR, H=2, weight_by_shard_size=weighted),
                                         3, batch_size=B, max_steps=4, **FIT)
        finals.append([node_params(k) for k in range(3)])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_option_validation():
    with pytest.raises(TypeError, match="weight_by_shard_size must be True or False, got 'yes'"):
        FedAvgStrategy(H=2, weight_by_shard_size="yes")
    with pytest.raises(ValueError, match="equal_local_steps=True .* pass local_epochs=E too"):
        FedAvgStrategy(H=2, equal_local_steps=True)
    FedAvgStrategy(local_epochs=1, equal_local_steps=True, weight_by_shard_size=False)
