"""The asynchronous strategies on the torch backend: real messages between processes, the server on a thread of
rank 0's process. A node slowed by real sleeps applies fewer updates than the fast ones in the same time."""

import pytest
import time

import torch

import toy
from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy


class SlowNodeTwo(AsyncDiLoCoStrategy):
    """AsyncDiLoCo whose node 2 sleeps 40 ms every step it computes (a real straggler)."""

    def step(self):
        if self.rank == 2 and not self.skip_compute():  # not in the steps it sits out past its budget
            time.sleep(0.04)
        super().step()


@pytest.mark.spawns
def test_on_the_torch_backend_the_fast_nodes_apply_more_updates():
    t = Trainer(toy.TinyMLP(), toy.make_classification(512), toy.make_classification(64, seed=1))
    model = t.fit(SlowNodeTwo(torch.optim.SGD, H=2, lr=0.05, time_budget_s=1.0), 3, max_steps=400, batch_size=8,
                  backend="torch", progress=False, logger=False, val_interval=400)
    per_node = [sum(1 for u in t.record.updates if u["node"] == n) for n in range(3)]
    # node 2's steps take >= 40 ms: at most 1.0 / 0.04 = 25 steps, 13 rounds; the others are not slowed
    assert per_node[2] <= 14 and min(per_node[0], per_node[1]) > 2 * per_node[2], per_node
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert t.record.updates and all(u["staleness"] >= 0 for u in t.record.updates)


class LongRounds(AsyncDiLoCoStrategy):
    """AsyncDiLoCo whose every step sleeps 0.8 s: each step well inside node_timeout=2 s, a round of 3 steps past it."""

    def step(self):
        time.sleep(0.8)
        super().step()


@pytest.mark.spawns
def test_a_round_longer_than_node_timeout_is_no_timeout():
    # node_timeout bounds a step, not a round: a node hears nothing between its pseudo-gradient and the server's
    # answer for a whole round. The receiver thread once waited for the next message with the process group's
    # timeout (node_timeout), and gloo's timeout broke every link: "Application timeout caused pair closure".
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(LongRounds(torch.optim.SGD, H=3, lr=0.05), 2, max_steps=3, batch_size=8, backend="torch", progress=False,
          logger=False, node_timeout=2.0)
    assert sorted(u["node"] for u in t.record.updates) == [0, 1]
