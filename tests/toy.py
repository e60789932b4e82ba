"""Small models, data and strategies shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from exogym.strategy import Strategy


def make_classification(n: int = 256, dim: int = 8, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(1))


class TinyMLP(torch.nn.Module):
    """model(batch) -> {"loss", "accuracy"}; optional dropout to exercise per-node RNG."""

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 3, dropout: float = 0.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(hidden, classes))

    def forward(self, batch):
        x, y = batch
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


class LossOnly(TinyMLP):
    def forward(self, batch):
        return super().forward(batch)["loss"]


# Strategies in tests record what each node saw here, keyed by the test's own tag and rank
# (every node works on its own deep copy of the strategy).
REGISTRY: dict = {}


class LocalOnly(Strategy):
    """Never communicates: each node trains alone. Keeps a handle on each node's model."""

    def __init__(self, lr: float = 0.1, tag: str = "local", **kwargs):
        super().__init__(**kwargs)
        self.lr, self.tag = lr, tag

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=self.lr)
        REGISTRY[(self.tag, rank)] = model

    def step(self):
        self.optim.step()
        super().step()


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_resumes_bit_identically(make_strategy, make_trainer, checkpoint_dir, nodes=4, steps=10, **fit):
    """A run stopped at steps // 2 and resumed from its checkpoint ends bit-identical to one never stopped."""
    full_t = make_trainer()
    full = full_t.fit(make_strategy(), nodes, max_steps=steps, **fit)
    make_trainer().fit(make_strategy(), nodes, max_steps=steps, checkpoint_interval=steps // 2,
                       checkpoint_dir=checkpoint_dir, **fit)
    resumed_t = make_trainer()
    resumed = resumed_t.fit(make_strategy(), nodes, max_steps=steps,
                            resume_from=checkpoint_dir / f"step_{steps // 2:09d}", **fit)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))
    assert resumed_t.record.node_loss == full_t.record.node_loss
    assert resumed_t.record.bytes_per_node == full_t.record.bytes_per_node
