"""A model whose pseudo-gradients can be derived by hand, and a replay of the event order on the simulated clock."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

TARGET = (1.0, -2.0)


class Pull(torch.nn.Module):
    """loss = 0.5 ||w - x||^2 for rows x = TARGET: the gradient is w - TARGET on every batch, so plain SGD at lr eta
    takes w from theta to TARGET + (1 - eta)^H (theta - TARGET) in H steps. The identity matmul gives the step a
    FLOP count (4 B^2... its forward: 2 B 2 2 FLOPs at batch B), so compute_time="flops" costs each step."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))

    def forward(self, batch):
        x, _ = batch
        x = x @ torch.eye(2)
        return 0.5 * ((self.w - x) ** 2).sum(1).mean()


def data(n: int = 96) -> TensorDataset:
    return TensorDataset(torch.tensor([TARGET] * n), torch.zeros(n))


def flops_per_step(batch: int) -> float:
    return 2.0 * batch * 2 * 2


def after_inner_steps(theta: torch.Tensor, steps: int, eta: float) -> torch.Tensor:
    target = torch.tensor(TARGET, dtype=theta.dtype)
    return target + (1 - eta) ** steps * (theta - target)


def arrivals(step_seconds: list[float], rounds: int, H: int, latency: float) -> list[tuple[float, int, int]]:
    """(arrival at the server, node, round k from 1): node i's k-th pseudo-gradient leaves after k H steps and
    2(k-1) one-way latencies (its earlier sends and replies), and arrives one latency later; sorted as the server
    takes them (time, then rank)."""
    return sorted((k * H * s + (2 * k - 1) * latency, i, k) for i, s in enumerate(step_seconds)
                  for k in range(1, rounds + 1))
