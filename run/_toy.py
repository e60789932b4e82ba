"""The tutorials' small task: a two-layer MLP classifying points of a fixed random linear rule (no download)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from exogym import Trainer


def points(n: int, seed: int, dim: int = 16, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    rule = torch.randn(dim, classes, generator=g)  # the same rule for training and validation data
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ rule).argmax(1))


class MLP(torch.nn.Module):
    """model(batch) -> {"loss", "accuracy"}: the model contract (a loss, or a dict with "loss")."""

    def __init__(self, dim: int = 16, hidden: int = 64, classes: int = 4):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, batch):
        x, y = batch
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


def train_on_points(strategy, steps: int) -> tuple[float, int]:
    """Train MLP on 4 nodes for `steps` steps from the same initial weights; (global validation loss, bytes sent
    per node)."""
    torch.manual_seed(0)
    trainer = Trainer(MLP(), points(4096, seed=1), points(512, seed=2))
    trainer.fit(strategy, 4, max_steps=steps, batch_size=32, val_interval=steps, progress=False, logger=False)
    return trainer.record.val[-1]["global_loss"], trainer.record.bytes_per_node[0]
