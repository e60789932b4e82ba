"""The workload both benchmarks time: a small CNN on MNIST-shaped synthetic data."""

from __future__ import annotations

import os
from typing import Callable, Hashable

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, batch):
        x, y = batch
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # [B, 16, 14, 14]
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # [B, 32, 7, 7]
        return F.cross_entropy(self.fc(x.flatten(1)), y)


@torch.no_grad()
def average_grads(models: list[torch.nn.Module]) -> None:
    """The plain loop's DDP: every model's gradients become their mean (the least any simulator must do)."""
    for params in zip(*(m.parameters() for m in models)):
        avg = params[0].grad.clone()
        for p in params[1:]:
            avg.add_(p.grad)
        avg.div_(len(models))
        for p in params:
            p.grad.copy_(avg)


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


class MLP(torch.nn.Module):
    """The MLP 784-256-256-10 of benchmarks/bench_fused.py, on the same MNIST-shaped data."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def make_tokens(n: int, block: int = 64, vocab: int = 65) -> TensorDataset:
    """n random sequences of `block` next-token pairs (character-level vocabulary size)."""
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, vocab, (n, block + 1), generator=g)
    return TensorDataset(t[:, :-1], t[:, 1:])


def ddp_keeping_k_copies(optim_spec):
    """DDP keeping every node's own copy and optimizer (one_replica = False), the arithmetic of a plain loop over
    K copies (SimpleReduceStrategy itself keeps one replica in the sim)."""
    from exogym.strategy import SimpleReduceStrategy

    class KCopies(SimpleReduceStrategy):
        one_replica = False

    return KCopies(optim_spec)


def fastest_interleaved(runs: dict[Hashable, Callable[[], float]], repeat: int) -> tuple[dict[Hashable, float], float]:
    """Each run `repeat` times, interleaved (so load moves them alike); warm-ups are the caller's.

    Args:
        runs: name -> a function returning the seconds it measured.
        repeat: how many times each runs.

    Returns:
        The fastest seconds of each, and the highest 1-minute load average seen.
    """
    best = {name: float("inf") for name in runs}
    load = os.getloadavg()[0]
    for _ in range(repeat):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best, max(load, os.getloadavg()[0])
