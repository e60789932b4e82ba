"""CNNs for 28x28 grey images (MNIST, Fashion-MNIST): a small one, the original EXO Gym example's, and the
FedAvg paper's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MnistCNN", "ExoGymMnistCNN", "FedAvgCNN", "random_affine"]


def random_affine(images: torch.Tensor, *, degrees: float = 10.0, translate: float = 0.1,
                  scale: tuple[float, float] = (0.9, 1.1)) -> torch.Tensor:
    """Rotate, shift and scale each image [B, C, H, W] at random (drawn from the global torch stream,
    which in a simulated run is the node's own)."""
    b = images.shape[0]
    angle = (torch.rand(b, device=images.device) * 2 - 1) * math.radians(degrees)
    s = torch.empty(b, device=images.device).uniform_(*scale)
    shift = (torch.rand(b, 2, device=images.device) * 2 - 1) * 2 * translate  # in [-1, 1] grid units
    cos, sin = torch.cos(angle) / s, torch.sin(angle) / s
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], 1), torch.stack([sin, cos, shift[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)  # [B, H, W, 2]
    return F.grid_sample(images, grid, padding_mode="border", align_corners=False)


class _ImageClassifier(nn.Module):
    """features -> head -> cross-entropy, with random_affine on training batches when self.augment is set."""

    features: nn.Module
    head: nn.Module
    augment: bool

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss and accuracy of a batch (training batches augmented when the model's `augment` is set).

        Args:
            batch: `(images, labels)`: images `[B, 1, 28, 28]` float, labels `[B]` int64.

        Returns:
            `{"loss": mean cross-entropy, "accuracy": fraction of labels predicted}`.
        """
        images, labels = batch
        if self.augment and self.training:
            images = random_affine(images)
        logits = self.head(self.features(images))  # [B, num_classes]
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}


class MnistCNN(_ImageClassifier):
    """Two conv blocks and a linear head; `model((images, labels))` -> `{"loss", "accuracy"}`.

    images: `[B, 1, 28, 28]` float, labels: `[B]` int64. About 20k parameters with the defaults.

    Args:
        channels: The two conv blocks' channels.
        num_classes: The number of classes.
        dropout: Dropout before the head.
        batch_norm: Add BatchNorm after each convolution.
        augment: Apply `random_affine` to training batches (the original ExoGym MNIST setup uses both this and
            `batch_norm`).
    """

    def __init__(self, channels: tuple[int, int] = (16, 32), num_classes: int = 10, dropout: float = 0.1,
                 batch_norm: bool = False, augment: bool = False):
        super().__init__()
        c1, c2 = channels
        norm = (lambda c: nn.BatchNorm2d(c)) if batch_norm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), norm(c1), nn.ReLU(), nn.MaxPool2d(2),   # [B, c1, 14, 14]
            nn.Conv2d(c1, c2, 3, padding=1), norm(c2), nn.ReLU(), nn.MaxPool2d(2),  # [B, c2, 7, 7]
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(c2 * 7 * 7, num_classes))
        self.augment = augment


class ExoGymMnistCNN(_ImageClassifier):
    """The CNN of the original EXO Gym's MNIST example (the curve in its README).

    Two blocks of two 3x3 convolutions (64, 64 then 128, 128 channels, padded), each convolution followed by
    BatchNorm and ReLU, each block by 2x2 max-pooling and Dropout2d(0.25); then Linear(6272, 256), ReLU,
    Dropout(0.5), Linear(256, 10): 1,868,234 parameters. `model((images, labels))` -> `{"loss", "accuracy"}`;
    images: `[B, 1, 28, 28]` float, labels: `[B]` int64.

    Args:
        num_classes: The number of classes.
        augment: Apply `random_affine` to training batches, as the original's published run did.
    """

    def __init__(self, num_classes: int = 10, augment: bool = True):
        super().__init__()

        def block(c_in: int, c_out: int) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                    nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                    nn.MaxPool2d(2), nn.Dropout2d(0.25)]

        self.features = nn.Sequential(*block(1, 64), *block(64, 128))  # [B, 64, 14, 14] -> [B, 128, 7, 7]
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(128 * 7 * 7, 256), nn.ReLU(), nn.Dropout(0.5),
                                  nn.Linear(256, num_classes))
        self.augment = augment


class FedAvgCNN(nn.Module):
    """The MNIST CNN of the FedAvg paper (McMahan et al. 2017, sec. 3).

    Two 5x5 convolutions with 32 and 64 channels, each followed by ReLU and 2x2 max pooling, a 512-unit dense
    layer with ReLU, and a 10-way softmax; 1,663,370 parameters. `model((images, labels))` ->
    `{"loss", "accuracy"}`; images: `[B, 1, 28, 28]` float, labels: `[B]` int64. The convolutions are padded
    ("same"), which is what makes the paper's parameter count: the dense layer sees 64 x 7 x 7 features.

    Args:
        num_classes: The number of classes.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),   # [B, 32, 14, 14]
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # [B, 64, 7, 7]
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, num_classes))

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss and accuracy of a batch.

        Args:
            batch: `(images, labels)`: images `[B, 1, 28, 28]` float, labels `[B]` int64.

        Returns:
            `{"loss": mean cross-entropy, "accuracy": fraction of labels predicted}`.
        """
        images, labels = batch
        logits = self.head(self.features(images))  # [B, num_classes]
        return {"loss": F.cross_entropy(logits, labels),
                "accuracy": (logits.argmax(dim=1) == labels).float().mean()}
