"""DeMo against an independent replay of the reference update rules (bloc97/DeMo, arXiv 2411.19870), under a
warm-up schedule, where accumulating lr x gradient (the reference) and the raw gradient part ways.

The replay below is written from the reference's description, in float64 numpy with scipy's DCT, and shares
no code with exogym.strategy.demo: per parameter and node, theta <- theta (1 - lr wd);
delta <- beta delta + lr g; per chunk, the top-k DCT coefficients of delta by magnitude leave delta and are
all-gathered; a coefficient is the mean over the nodes that sent it; theta <- theta - lr sign(IDCT(mean)).
"""

import numpy as np
import pytest
import torch
from scipy.fft import dctn, idctn

from exogym import Trainer
from exogym.strategy import DeMoStrategy
from strategy_toys import FIT

NODES, STEPS, TOPK, CHUNK, DECAY, LR, WD = 3, 8, 3, 4, 0.9, 0.05, 0.1
SEEN: dict[int, list[tuple[float, list[np.ndarray]]]] = {}  # rank -> per step (lr, gradients)


class Recorded(DeMoStrategy):
    """DeMo that records, per node and step, the lr it steps with and the gradients it was handed."""

    def step(self):
        SEEN.setdefault(self.rank, []).append((self.optim.param_groups[0]["lr"],
                                               [p.grad.double().numpy().copy() for p in self.model.parameters()]))
        super().step()


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 6)  # weight [6, 8] (2-D chunks of 2 x 4), bias [6] (chunks of 3)

    def forward(self, batch):
        x, y = batch
        return ((self.lin(x) - y) ** 2).mean()


def _blocks(shape):
    """The reference's chunking: each dimension cut at its largest divisor <= CHUNK (a vector along its one axis)."""
    return tuple(max(d for d in range(1, min(n, CHUNK) + 1) if n % d == 0) for n in shape)


def _to_blocks(x, b):  # [rows, cols] -> [rows/h, cols/w, h, w]; a vector -> [n/w, 1, 1, w]
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    h, w = (1, b[0]) if x.ndim == 1 else b
    return x2.reshape(x2.shape[0] // h, h, x2.shape[1] // w, w).transpose(0, 2, 1, 3)


def _from_blocks(blocks, shape):
    a, c, h, w = blocks.shape
    return blocks.transpose(0, 2, 1, 3).reshape(a * h, c * w).reshape(shape)


def reference_replay(init: list[np.ndarray], seen, *, lr_scaled: bool) -> list[np.ndarray]:
    params = [p.copy() for p in init]
    delta = [[np.zeros_like(p) for p in init] for _ in range(NODES)]
    for step in range(STEPS):
        lr = seen[0][step][0]
        for i, p in enumerate(params):
            b = _blocks(p.shape)
            sums = counts = 0
            for r in range(NODES):
                g = seen[r][step][1][i]
                delta[r][i] = DECAY * delta[r][i] + (lr if lr_scaled else 1.0) * g
                coeffs = dctn(_to_blocks(delta[r][i], b), axes=(2, 3), norm="ortho")
                flat = coeffs.reshape(*coeffs.shape[:2], -1)
                top = np.argsort(-np.abs(flat), axis=-1, kind="stable")[..., :TOPK]
                chosen = np.zeros_like(flat)
                np.put_along_axis(chosen, top, np.take_along_axis(flat, top, -1), -1)
                sent = np.zeros_like(flat, dtype=bool)
                np.put_along_axis(sent, top, True, -1)
                delta[r][i] = delta[r][i] - _from_blocks(idctn(chosen.reshape(coeffs.shape), axes=(2, 3),
                                                               norm="ortho"), p.shape)
                sums, counts = sums + chosen, counts + sent
            mean = sums / np.maximum(counts, 1)
            direction = _from_blocks(idctn(mean.reshape(coeffs.shape), axes=(2, 3), norm="ortho"), p.shape)
            params[i] = p * (1 - lr * WD) - lr * np.sign(direction)
    return params


def run(**kwargs):
    SEEN.clear()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 6))
    model = Regression()
    init = [p.detach().double().numpy().copy() for p in model.parameters()]
    strategy = Recorded(lr=LR, compression_decay=DECAY, compression_topk=TOPK, compression_chunk=CHUNK,
                        weight_decay=WD, lr_scheduler=torch.optim.lr_scheduler.LinearLR,
                        lr_scheduler_kwargs={"start_factor": 0.25, "total_iters": STEPS}, **kwargs)
    trained = Trainer(model, data).fit(strategy, NODES, batch_size=8, max_steps=STEPS, **FIT)
    lrs = [lr for lr, _ in SEEN[0]]
    assert len(set(lrs)) == STEPS and lrs[0] == pytest.approx(0.25 * LR)  # the warm-up is in force
    return init, [p.detach().double().numpy() for p in trained.parameters()]


@pytest.mark.parametrize("lr_scaled", [True, False])
def test_demo_matches_the_reference_replay_under_warm_up(lr_scaled):
    init, got = run() if lr_scaled else run(lr_scaled_momentum=False)
    want = reference_replay(init, SEEN, lr_scaled=lr_scaled)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)  # float rounding; a flipped sign would cost 2 lr
    other = reference_replay(init, SEEN, lr_scaled=not lr_scaled)  # the two variants really part ways here
    assert max(np.abs(g - o).max() for g, o in zip(got, other)) > LR / 2


def test_lr_scaled_momentum_is_validated():
    with pytest.raises(TypeError, match="lr_scaled_momentum must be True .* got 'yes'"):
        DeMoStrategy(lr=1e-3, lr_scaled_momentum="yes")
    DeMoStrategy(lr=1e-3, lr_scaled_momentum=False)
