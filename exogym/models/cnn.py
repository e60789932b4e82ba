"""A small CNN for 28x28 grey images (MNIST, Fashion-MNIST)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MnistCNN"]


class MnistCNN(nn.Module):
    """Two conv blocks and a linear head; `model((images, labels))` -> {"loss", "accuracy"}.

    images: [B, 1, 28, 28] float, labels: [B] int64. ~20k parameters with the defaults.
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), num_classes: int = 10, dropout: float = 0.1):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # [B, c1, 14, 14]
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # [B, c2, 7, 7]
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * 7 * 7, num_classes))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = self.head(self.features(images))  # [B, num_classes]
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
