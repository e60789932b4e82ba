"""Fashion-MNIST (Xiao et al. 2017): 70,000 28x28 grey images of clothing in 10 classes, from Debian's idx files.

`apt-get install -y dataset-fashion-mnist` puts the four files in /usr/share/datasets/fashion-mnist/,
the default `root`; any folder holding {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] works too.
Reading them takes under a second, so nothing is cached.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from exogym.data.idx import IMAGES_MAGIC, LABELS_MAGIC, read_idx

__all__ = ["load_fashion_mnist", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "FASHION_MNIST_CLASSES",
           "DEBIAN_FASHION_MNIST"]

# Mean and std of the 60,000 training pixels on the [0, 1] scale.
FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def load_fashion_mnist(split: str = "train", *, root: str | os.PathLike | None = None,
                       normalize: bool = True) -> TensorDataset:
    """Fashion-MNIST as a TensorDataset(images float32 `[N, 1, 28, 28]`, labels int64 `[N]`).

    N = 60,000 (`"train"`) or 10,000 (`"test"`). Pixels are uint8/255; with `normalize`,
    `(x - FASHION_MNIST_MEAN) / FASHION_MNIST_STD`. Labels index `FASHION_MNIST_CLASSES`.

    Args:
        split: `"train"` or `"test"`.
        root: The folder with the idx files (default: where Debian's package `dataset-fashion-mnist` puts them).
        normalize: Normalize the pixels.

    Returns:
        The TensorDataset.

    Raises:
        ValueError: An unknown split.
        RuntimeError: The files are missing (saying how to get them) or malformed.
    """
    if split not in _FILES:
        raise ValueError(f"split must be one of {list(_FILES)}, got {split!r}")
    folder = Path(root).expanduser() if root is not None else DEBIAN_FASHION_MNIST
    images_name, labels_name = _FILES[split]
    images = read_idx(_find(folder, images_name), IMAGES_MAGIC)  # uint8 [N, 28, 28]
    labels = read_idx(_find(folder, labels_name), LABELS_MAGIC)  # uint8 [N]
    if len(images) != len(labels):
        raise RuntimeError(f"{folder}: the {split} idx files hold {len(images)} images but {len(labels)} labels; "
                           "replace them with a matching pair")
    x = torch.from_numpy(images).float().div_(255).unsqueeze(1)  # [N, 28, 28] -> [N, 1, 28, 28]
    if normalize:
        x.sub_(FASHION_MNIST_MEAN).div_(FASHION_MNIST_STD)
    return TensorDataset(x, torch.from_numpy(labels).long())


def _find(folder: Path, name: str) -> Path:
    for path in (folder / f"{name}.gz", folder / name):
        if path.exists():
            return path
    files = ", ".join(n for pair in _FILES.values() for n in pair)
    raise RuntimeError(
        f"Fashion-MNIST's {name}[.gz] is not in {folder}. On Debian or Ubuntu install it with:\n"
        f"  apt-get install -y dataset-fashion-mnist\n"
        f"which puts the files in {DEBIAN_FASHION_MNIST} (the default root); or pass root= a folder holding "
        f"{files} (plain or .gz), e.g. from https://github.com/zalandoresearch/fashion-mnist")
