"""A small MLP classifier for vector data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPClassifier"]


class MLPClassifier(nn.Module):
    """A multilayer perceptron classifier: `model((x, labels))` -> `{"loss", "accuracy"}`.

    x: `[B, in_dim]` float, labels: `[B]` int64.

    Args:
        in_dim: The input's features.
        num_classes: The number of classes.
        hidden: The hidden layer's width.
        dropout: Dropout after the hidden layer's ReLU.
    """

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 64, dropout: float = 0.0):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss and accuracy of a batch.

        Args:
            batch: `(x, labels)`: x `[B, in_dim]` float, labels `[B]` int64.

        Returns:
            `{"loss": mean cross-entropy, "accuracy": fraction of labels predicted}`.
        """
        x, labels = batch
        logits = self.net(x.flatten(1))  # [B, num_classes]
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
