"""A small MLP classifier for vector data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPClassifier"]


class MLPClassifier(nn.Module):
    """`model((x, labels))` -> {"loss", "accuracy"}; x: [B, in_dim] float, labels: [B] int64."""

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, labels = batch
        logits = self.net(x.flatten(1))  # [B, num_classes]
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
