"""Streaming DiLoCo's two overlap schedules, each against a hand replay on two fragments: the paper's (send at the
fragment's boundary, apply tau steps later) and torchft's (send tau steps before the boundary, apply at it)."""

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import TensorDataset

from exogym import Trainer
from exogym.strategy import OptimSpec, StreamingDiLoCoStrategy
from strategy_toys import FIT

GRADS = [[1.0, -2.0, 0.5, 4.0], [3.0, 0.0, -1.0, 1.0]]  # node r's constant gradient: layer a, then layer b
INIT = [1.0, 2.0, 3.0, -1.0]
ETA, H, F, TAU, ALPHA, OUTER_LR, STEPS = 0.1, 8, 2, 2, 0.5, 0.7, 23
TRACE: dict = {}


class TwoLayers(torch.nn.Module):
    """Two modules (two fragments) a and b; loss = <a.w, c[:2]> + <b.w, c[2:]>, so node r's gradient is c_r."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        self.a.w = torch.nn.Parameter(torch.tensor(INIT[:2]))
        self.b.w = torch.nn.Parameter(torch.tensor(INIT[2:]))

    def forward(self, batch):
        (c,) = batch
        c = c.mean(0)
        return (self.a.w * c[:2]).sum() + (self.b.w * c[2:]).sum()


class Trace(StreamingDiLoCoStrategy):
    def step(self):
        super().step()
        master = torch.cat([g.detach().reshape(-1) for g in self.modules[0].master])
        local = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        TRACE[(self.rank, self.local_step)] = (master.clone(), local.clone())


def replay(overlap):
    """Plain outer SGD by hand. Window w (w = 1, 2, ...) ends at step w H/F and belongs to fragment (w-1) mod F. The
    fragment's mean pseudo-gradient theta_g - theta_r is taken when it is sent, which is at the window's end
    ('paper') or tau steps before it ('torchft'); tau steps after sending, theta_g[f] -= lr mean and each node
    merges theta_r[f] = lerp(theta_g[f], theta_r[f], alpha). What is in flight at the last step is applied then
    (final_sync=False: nothing more)."""
    every = H // F
    frag = [slice(0, 2), slice(2, 4)]
    c = torch.tensor(GRADS)
    g, local, flight, out = torch.tensor(INIT), [torch.tensor(INIT)] * 2, [], {}
    shift = TAU if overlap == "torchft" else 0
    for t in range(1, STEPS + 1):
        local = [x - ETA * c[r] for r, x in enumerate(local)]
        if (t + shift) % every == 0:
            f = frag[((t + shift) // every - 1) % F]
            flight.append((t + TAU, f, torch.stack([g[f] - x[f] for x in local]).mean(0)))
        while flight and (flight[0][0] <= t or t == STEPS):
            _, f, mean = flight.pop(0)
            g = g.clone()
            g[f] = g[f] - OUTER_LR * mean
            local = [x.clone() for x in local]
            for x in local:
                x[f] = (1 - ALPHA) * g[f] + ALPHA * x[f]
        out[t] = (g, local)
    return out


@pytest.mark.parametrize("overlap", ["paper", "torchft"])
def test_overlap_schedule_matches_its_hand_replay(overlap):
    TRACE.clear()
    strategy = Trace(OptimSpec(torch.optim.SGD, lr=ETA), H=H, num_fragments=F, fragment_pattern="sequential", tau=TAU,
                     alpha=ALPHA, outer_lr=OUTER_LR, outer_momentum=0.0, overlap=overlap,
                     final_sync=False)  # the schedule alone; the final synchronisation has its own tests
    data = lambda rank, num_nodes, is_val: TensorDataset(torch.tensor([GRADS[rank]] * 8))  # noqa: E731
    Trainer(TwoLayers(), data).fit(strategy, 2, batch_size=4, max_steps=STEPS, **FIT)
    expected = replay(overlap)
    for t in range(1, STEPS + 1):
        g, local = expected[t]
        for r in range(2):
            assert_close(TRACE[(r, t)][0], g, rtol=1e-5, atol=1e-6, msg=f"{overlap}: global model after step {t}")
            assert_close(TRACE[(r, t)][1], local[r], rtol=1e-5, atol=1e-6, msg=f"{overlap}: node {r} after step {t}")
    other = replay("torchft" if overlap == "paper" else "paper")  # the schedules really differ step by step
    assert any(not torch.allclose(other[t][0], expected[t][0]) for t in range(1, STEPS + 1))
    first_move = min(t for t in range(1, STEPS + 1) if not torch.equal(expected[t][0], torch.tensor(INIT)))
    assert first_move == (H // F + TAU if overlap == "paper" else H // F)  # applied tau late, or at the boundary


def test_overlap_names_are_validated():
    with pytest.raises(ValueError, match=r"overlap must be one of \['paper', 'torchft'\] .* got 'eager'"):
        StreamingDiLoCoStrategy(overlap="eager")
    StreamingDiLoCoStrategy(overlap="torchft")
