"""FedAvg: islands average only within themselves; unsampled clients do nothing and send nothing."""

import math

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import FedAvgStrategy, OptimSpec
from strategy_toys import FIT, NODES, flat, node_params, run_linear, watched

ETA = 0.1
GRADS = [[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [3.0, -2.0], [0.5, 0.5], [2.0, 1.0]]
INIT = [1.0, -1.0]
MODEL_BYTES = 2 * 4


def fedavg(**kwargs):
    return watched(FedAvgStrategy)(OptimSpec(torch.optim.SGD, lr=ETA), **kwargs)


def trained(rank: int, steps: int) -> torch.Tensor:
    return torch.tensor(INIT) - steps * ETA * torch.tensor(GRADS[rank])


def test_islands_average_only_within_themselves():
    _, t = run_linear(fedavg(H=2, island_size=2, seed=5), GRADS[:4], INIT, 2)
    islands = NODES[0][1].modules[0].islands(0)
    assert sorted(r for island in islands for r in island) == [0, 1, 2, 3] and all(len(i) == 2 for i in islands)
    for island in islands:
        expected = torch.stack([trained(r, 2) for r in island]).mean(0)
        for r in island:
            assert_close(node_params(r), expected)
    # One all-reduce within a pair per round: 2 N (2-1)/2 = N bytes, not the world's 2 N (4-1)/4.
    assert t.record.bytes_per_node == [all_reduce_bytes(MODEL_BYTES, 2)] * 4 == [MODEL_BYTES] * 4


def test_islands_are_reshuffled_each_round_and_cover_every_node_once():
    run_linear(fedavg(island_size=2, seed=0), GRADS, INIT, 1)
    module = NODES[0][1].modules[0]
    partitions = set()
    for i in range(12):
        islands = module.islands(i)
        assert sorted(r for island in islands for r in island) == list(range(6))
        assert [len(island) for island in islands] == [2, 2, 2]
        partitions.add(tuple(map(tuple, islands)))
        assert islands == NODES[5][1].modules[0].islands(i)  # every node computes the same islands
    assert len(partitions) > 1


def test_unsampled_clients_do_no_compute_send_nothing_and_keep_their_parameters():
    H, K = 3, 6
    strategy = fedavg(H=H, client_sampling=0.5, seed=0)
    _, t = run_linear(strategy, GRADS, INIT, H - 1)  # mid-round
    module = NODES[0][1].modules[0]
    now, upcoming = module.participants(0), module.participants(1)
    newcomers = [r for r in upcoming if r not in now]
    idle = [r for r in range(K) if r not in now]
    assert len(now) == 3 and newcomers and [r for r in idle if r not in upcoming], (now, upcoming)
    for r in idle:
        assert torch.equal(node_params(r), torch.tensor(INIT))
        assert t.record.bytes_per_node[r] == 0
        assert all(math.isnan(loss) for loss in t.record.node_loss[r])  # no forward, no loss
    for r in now:
        assert_close(node_params(r), trained(r, H - 1))
        assert not any(math.isnan(loss) for loss in t.record.node_loss[r])

    model, t = run_linear(strategy, GRADS, INIT, H)  # the round ends
    average = torch.stack([trained(r, H) for r in now]).mean(0)
    for r in range(K):
        if r in now or r in newcomers:  # the next round's newcomers receive the new model at the round's end
            assert_close(node_params(r), average)
        else:
            assert torch.equal(node_params(r), torch.tensor(INIT))
    senders = [now[i % len(now)] for i in range(len(newcomers))]
    for r in range(K):
        expected = (all_reduce_bytes(MODEL_BYTES, 3) if r in now else 0) + MODEL_BYTES * senders.count(r)
        assert t.record.bytes_per_node[r] == expected, r
    assert_close(flat(model), average)  # the global model: the average the round produced
    assert t.record.train[0]["loss"] == sum(t.record.node_loss[r][0] for r in now) / 3  # over the nodes that trained


@pytest.mark.filterwarnings("error:Detected call of")  # a node that sat out still advances its LR schedule quietly
def test_client_sampling_on_a_real_task_trains_and_costs_only_the_sampled_compute():
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(512))
    trainer.fit(FedAvgStrategy("sgd", H=4, client_sampling=0.25, lr=0.2, warmup_steps=2), 8, batch_size=8, max_steps=40,
                device_flops=1e9, **FIT)
    computed = [sum(not math.isnan(x) for x in losses) for losses in trainer.record.node_loss]
    assert sum(computed) == 2 * 40  # two sampled clients per round, every step
    compute = [c["compute_s"] for c in trainer.record.sim_time_per_node]
    per_step = max(compute) / max(computed)
    assert all(abs(c - n * per_step) < 1e-9 for c, n in zip(compute, computed))
    losses = trainer.record.column("loss")
    assert sum(losses[-8:]) < sum(losses[:8])


def test_local_epochs_make_a_round_of_whole_passes_over_the_shard():
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
    trainer.fit(watched(FedAvgStrategy)("sgd", local_epochs=2, lr=0.1), 2, batch_size=16, num_epochs=4, **FIT)
    assert trainer.record.config["steps_per_epoch"] == 4
    assert NODES[0][1].H == 8
    assert trainer.record.comm_per_node[0]["calls_by_op"] == {"all_reduce": 2}  # 16 steps, a round every 8
