"""The asynchronous Local-SGD framework's task options against hand replays (Liu et al., arXiv:2401.09135, and its
toy simulator): the grace window's update sequence on the toy study's four speeds, Dynamic Local Updates from given
speeds (eq. 6), the shard of each task, a fresh inner optimizer per task, and the total local updates axis."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import replay  # noqa: I001
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import AsyncDiLoCoStrategy, FedBuffStrategy, OptimSpec
from exogym.strategy.async_tasks import ShardSampler, speed_steps
from exogym.strategy.lr_schedule import lambda_cosine

FIT = dict(progress=False, device="cpu", logger=False)
STEP_S = (0.58, 0.75, 1.51, 3.33)  # the toy study's seconds per step
B = 8


def _fit(strategy, *, steps, data=None, step_s=STEP_S, **kw):
    t = Trainer(replay.Pull(), data if data is not None else replay.data(4 * B * steps), replay.data(B))
    t.fit(strategy, len(step_s), batch_size=B, max_steps=steps, val_size=B, val_interval=steps, node_speeds=[1.0 / s for s in step_s],
          device_flops=replay.flops_per_step(B), compute_time="flops", network=Network(bandwidth="inf", latency=0.0),
          **FIT, **kw)
    return t


def grace_replay(step_s, H, grace, rounds):
    """(time, node, staleness) of every update, from the rule's text: an arrival with no window open opens one of
    `grace` seconds; arrivals inside it are applied as they come; at its end every node whose update it applied
    starts its next task from the server's version then. grace = 0: each node restarts at its own arrival."""
    finish = {i: H * s for i, s in enumerate(step_s)}
    began = {i: 0 for i in finish}  # the version each node's task started from
    left = {i: rounds for i in finish}
    version, window_end, held, out = 0, None, [], []
    while finish:
        node, t = min(finish.items(), key=lambda kv: (kv[1], kv[0]))
        if window_end is not None and t > window_end:  # the window closes before this arrival
            for r in held:
                began[r] = version
                if left[r]:
                    finish[r] = window_end + H * step_s[r]
            window_end, held = None, []
            continue
        del finish[node]
        out.append((t, node, version - began[node]))
        version += 1
        left[node] -= 1
        if grace == 0:
            began[node] = version
            if left[node]:
                finish[node] = t + H * step_s[node]
            continue
        if window_end is None:
            window_end = t + grace
        held.append(node)
        if not finish:  # the last window closes with nothing after it
            for r in held:
                began[r] = version
                if left[r]:
                    finish[r] = window_end + H * step_s[r]
            window_end, held = None, []
    return out


def test_the_grace_window_update_sequence_on_the_toy_study_speeds():
    H, rounds = 20, 3
    t = _fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=H, grace_s=0.5), steps=H * rounds)
    expected = grace_replay(STEP_S, H, 0.5, rounds)
    got = [(u["sim_time_s"], u["node"], u["staleness"]) for u in t.record.updates]
    assert [(n, tau) for _, n, tau in got] == [(n, tau) for _, n, tau in expected]
    assert all(math.isclose(a, b, rel_tol=1e-9) for (a, _, _), (b, _, _) in zip(got, expected))
    # by hand: node 0 at 11.6 s (window to 12.1), node 1 at 15.0 (to 15.5), node 0 at 23.7, node 2 at 30.2 opens a
    # window that node 1 (restarted at 15.5, done at 30.5) falls in: both restart at 30.7 from version 5
    assert [(round(a, 6), n, tau) for a, n, tau in got[:5]] == [(11.6, 0, 0), (15.0, 1, 1), (23.7, 0, 1),
                                                                 (30.2, 2, 3), (30.5, 1, 2)]
    assert (round(got[5][0], 6), got[5][1]) == (35.8, 0)  # node 0 restarted at 24.2: 24.2 + 11.6
    # without the window the sequence departs at the 4th update (node 1 back at 30.0, before node 2)
    plain = grace_replay(STEP_S, H, 0.0, rounds)
    assert [n for _, n, _ in plain[:5]] == [0, 1, 0, 1, 2]
    t0 = _fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=H), steps=H * rounds)
    assert [(u["node"], u["staleness"]) for u in t0.record.updates] == [(n, tau) for _, n, tau in plain]


def test_dynamic_local_updates_from_given_speeds_is_eq_6_from_the_first_task():
    assert speed_steps(20, [1 / s for s in STEP_S], 1) == [20, 15, 7, 3]  # floor(20 x 0.58 / s_i)
    assert speed_steps(20, [1 / s for s in STEP_S], 5) == [20, 15, 7, 5]
    t = _fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=20, dynamic_local_updates="speeds"),
             steps=21)
    steps = {n: [u["steps"] for u in t.record.updates if u["node"] == n] for n in range(4)}
    # the first task already: node 3 sends every 3 steps (21 = 7 x 3), node 2 every 7, node 1 15 then the 6 left
    assert steps[3] == [3] * 7 and steps[2] == [7] * 3 and steps[1] == [15, 6] and steps[0] == [20, 1]
    assert t.record.val[-1]["local_steps"] == 4 * 21


def test_least_visited_sampling_takes_a_shard_with_the_fewest_tasks():
    s = ShardSampler("least_visited", [10] * 4, [20, 20, 20, 20], seed=0)
    picks = [s.assign(20) for _ in range(8)]
    # every shard has one task (node r's first); the next four are a permutation, then the next four again
    assert sorted(sh for sh, _ in picks[:4]) == [0, 1, 2, 3] and sorted(sh for sh, _ in picks[4:]) == [0, 1, 2, 3]
    # each task starts where the shard's last one ended: 20, then 40
    assert sorted(p for _, p in picks[:4]) == [20] * 4 and sorted(p for _, p in picks[4:]) == [40] * 4


def test_undersampled_sampling_draws_only_shards_under_their_share():
    s = ShardSampler("undersampled", [10, 10, 20], [5, 5, 5], seed=0)
    # shares of data 1/4, 1/4, 1/2; of steps 1/3 each: only shard 2 is under its share
    assert s.assign(5) == (2, 5)
    # now 5, 5, 10 of 20 steps: every shard at its share, so a uniform draw
    assert torch.equal(s._weights(), torch.ones(3, dtype=torch.float64))
    s.handed = [5, 5, 15]  # of 25 steps: 0.25 - 0.2 = 0.05 under for shards 0 and 1, shard 2 over (0.6 > 0.5)
    assert torch.allclose(s._weights(), torch.tensor([0.05, 0.05, 0.0], dtype=torch.float64))
    assert {s.assign(5)[0] for _ in range(1)} <= {0, 1}


def _indexed(n):
    """Rows whose first feature is their index (the Pull model ignores it; batches name their examples)."""
    x = torch.zeros(n, 2)
    x[:, 0] = torch.arange(n, dtype=torch.float)
    return TensorDataset(x, torch.zeros(n))


class Seen(AsyncDiLoCoStrategy):
    """Keeps, for every step a node trains, (rank, task's shard, position in the shard, the batch's example indices)."""

    log: list = []

    def step(self):
        Seen.log.append((self.rank, self._shard, *self._last, self.current_lr()))
        super().step()

    def read_batches(self, batches, from_step):
        inner = super().read_batches(batches, from_step)

        def tagged():
            for batch in inner:
                self._last = (self._reader.position - 1, batch[0][:, 0].long().tolist())
                yield batch
        return tagged()


def test_each_task_reads_its_sampled_shard_from_where_the_last_task_on_it_ended():
    from exogym.data.sharding import NodeBatches
    Seen.log = []
    data = _indexed(4 * B * 30)
    _fit(Seen(OptimSpec(torch.optim.SGD, lr=0.1), H=4, shard_sampling="least_visited", shard_seed=3,
              lr_scheduler="lambda_cosine", cosine_anneal=True), steps=12, data=data, step_s=(1.0, 1.0, 2.0, 2.0),
         seed=0)
    cosine = lambda_cosine(warmup_steps=0, max_steps=12, cosine_anneal=True, min_lr_factor=0.1)
    streams = [list(zip(range(40), NodeBatches(data, rank=r, num_nodes=4, batch_size=B, shuffle=True, seed=0,
                                               shard=True).index_batches(0))) for r in range(4)]
    for rank, shard, position, idx, lr in Seen.log:
        assert idx == streams[shard][position][1]  # one stream per shard, whichever node takes a task on it
        assert math.isclose(lr, 0.1 * cosine(position), rel_tol=1e-12)  # the shard's own cosine, at its position
    places = [(shard, position) for _, shard, position, _, _ in Seen.log]
    assert len(places) == len(set(places)) == 4 * 12  # no batch of a shard read twice
    # least visited: after the four first tasks (node r on shard r), the next four tasks take the four shards
    tasks = sorted({(position // 4, shard) for _, shard, position, _, _ in Seen.log})
    assert {shard for k, shard in tasks if k == 1} == {0, 1, 2, 3}
    assert {shard for rank, shard, _, _, _ in Seen.log if rank == 0} != {0}  # node 0 trained on other shards too


def test_shard_sampling_refuses_data_that_is_each_nodes_own_and_processes_before_any_node_starts(monkeypatch):
    from exogym.engine.node import TrainNode
    monkeypatch.setattr(TrainNode, "run", lambda *a: pytest.fail("a node started"))
    def factory(rank, n, is_val):
        return replay.data(64)
    with pytest.raises(ValueError, match="each node's own"):
        Trainer(replay.Pull(), factory).fit(AsyncDiLoCoStrategy(H=2, shard_sampling="least_visited"), 2,
                                            max_steps=2, batch_size=B, **FIT)
    with pytest.raises(ValueError, match="runs in one process"):
        Trainer(replay.Pull(), replay.data(64)).fit(AsyncDiLoCoStrategy(H=2, shard_sampling="undersampled"), 2,
                                                    max_steps=2, batch_size=B, processes=2, **FIT)


def test_a_fresh_inner_optimizer_per_task():
    # one node, H = 1, outer SGD at lr 1 without momentum: theta moves by exactly one inner Adam step per update.
    # A fresh Adam's first step is lr x g / (|g| + eps) per weight: 0.1 towards the target (1, -2) each time.
    def run(inner_state):
        t = Trainer(replay.Pull(), replay.data(64))
        return t.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.Adam, lr=0.1, eps=1e-12), H=1, outer_lr=1.0,
                                         outer_momentum=0.0, inner_state=inner_state), 1, batch_size=B,
                     max_steps=4, **FIT).w.detach()
    torch.testing.assert_close(run("reset"), torch.tensor([0.4, -0.4]), rtol=0, atol=1e-6)
    assert (run("keep") - torch.tensor([0.4, -0.4])).abs().max() > 1e-3  # moments carried over: other steps


def test_fedbuff_takes_the_task_options_too():
    t = _fit(FedBuffStrategy(H=4, buffer_size=2, dynamic_local_updates="speeds", shard_sampling="undersampled"),
             steps=8)
    assert t.record.updates and t.record.val[-1]["local_steps"] == sum(4 * [8])


def test_the_total_local_updates_axis_for_a_server_run_and_a_synchronous_one():
    from exogym.runs.plot import _series, load_run
    from exogym.strategy import DiLoCoStrategy
    t = _fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2), steps=4, step_s=(1.0, 1.0, 2.0, 2.0))
    xs, _ = _series(load_run(t.record), "local_steps", "global_loss")
    assert xs == [0, 16]  # the server's count: every node's 4 steps applied by the end
    s = Trainer(replay.Pull(), replay.data(64), replay.data(B))
    s.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2), 3, batch_size=B, max_steps=4, val_size=B,
          val_interval=2, **FIT)
    xs, _ = _series(load_run(s.record), "local_steps", "global_loss")
    assert xs == [0, 6, 12]  # three nodes, every step
