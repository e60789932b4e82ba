"""CIFAR-10 (Krizhevsky 2009) from the standard `cifar-10-batches-py` folder, at a path you give.

No package registry carries CIFAR-10, so nothing is fetched: download the "CIFAR-10 python version"
(cifar-10-python.tar.gz, 163 MB) from https://www.cs.toronto.edu/~kriz/cifar.html, extract it with
`tar xzf cifar-10-python.tar.gz`, and pass the `cifar-10-batches-py` folder (or the folder holding it).

Each batch file is a pickled dict: b"data" uint8 [10000, 3072] (1024 red, then green, then blue values
of a 32x32 image, row by row) and b"labels" (10000 ints in 0-9). The pickles are read with an
unpickler that builds only dicts, lists, strings, numbers and numpy arrays, so a file that is not
what it claims to be cannot run code.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["load_cifar10", "CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10_CLASSES"]

# Per-channel mean and std of the 50,000 training images on the [0, 1] scale (red, green, blue).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

_FOLDER = "cifar-10-batches-py"
_BATCHES = {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)}
_HOW = ("download the CIFAR-10 python version (cifar-10-python.tar.gz) from "
        "https://www.cs.toronto.edu/~kriz/cifar.html, extract it with `tar xzf cifar-10-python.tar.gz`, "
        f"and pass the {_FOLDER} folder it makes")


def load_cifar10(path: str | os.PathLike, split: str = "train", *, normalize: bool = True) -> TensorDataset:
    """CIFAR-10 as a TensorDataset(images float32 `[N, 3, 32, 32]`, labels int64 `[N]`).

    N = 50,000 (`"train"`) or 10,000 (`"test"`). Pixels are uint8/255; with `normalize`, each channel becomes
    `(x - CIFAR10_MEAN[c]) / CIFAR10_STD[c]`. Labels index `CIFAR10_CLASSES`.

    Args:
        path: The `cifar-10-batches-py` folder or the folder holding it (no package registry carries CIFAR-10).
        split: `"train"` or `"test"`.
        normalize: Normalize each channel.

    Returns:
        The TensorDataset.

    Raises:
        ValueError: An unknown split.
        RuntimeError: The folder or a batch file is missing or is not CIFAR-10's (saying how to get it).
    """
    if split not in _BATCHES:
        raise ValueError(f"split must be one of {list(_BATCHES)}, got {split!r}")
    folder = _batches_folder(Path(path).expanduser())
    images, labels = [], []
    for name in _BATCHES[split]:
        x, y = _read_batch(folder / name)
        images.append(x)
        labels.append(y)
    x = torch.from_numpy(np.concatenate(images)).reshape(-1, 3, 32, 32)  # [N, 3072] -> [N, 3, 32, 32]
    x = x.float().div_(255)
    if normalize:
        x.sub_(torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)).div_(torch.tensor(CIFAR10_STD).view(1, 3, 1, 1))
    return TensorDataset(x, torch.from_numpy(np.concatenate(labels)))


def _batches_folder(path: Path) -> Path:
    for folder in (path, path / _FOLDER):
        if (folder / "test_batch").exists() or (folder / "data_batch_1").exists():
            return folder
    where = ("does not exist" if not path.exists() else
             f"holds no data_batch_1 or test_batch (nor does {path / _FOLDER})")
    raise RuntimeError(f"CIFAR-10 was not found: {path} {where}. No package registry carries it; {_HOW}")


def _read_batch(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [n, 3072] and int64 [n] from one batch file, checked."""
    if not file.exists():
        raise RuntimeError(f"{file} is missing (a complete {_FOLDER} has data_batch_1 to data_batch_5 and "
                           f"test_batch); {_HOW}")
    try:
        with open(file, "rb") as f:
            batch = _SafeUnpickler(f, encoding="bytes").load()  # written by Python 2: keys are bytes
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise RuntimeError(f"{file} is not a CIFAR-10 batch file ({e}); {_HOW}") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise RuntimeError(f"{file} is not a CIFAR-10 batch file: expected a dict with b'data' and b'labels', "
                           f"got {keys}")
    data, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise RuntimeError(f"{file}: b'data' must be uint8 [n, 3072], got {data.dtype} {list(data.shape)}")
    if labels.shape != (len(data),) or not np.issubdtype(labels.dtype, np.integer) or \
            (len(labels) and (labels.min() < 0 or labels.max() > 9)):
        raise RuntimeError(f"{file}: b'labels' must be {len(data)} ints in 0-9, got {labels.dtype} "
                           f"{list(labels.shape)}")
    return data, labels.astype(np.int64)


class _SafeUnpickler(pickle.Unpickler):
    """Builds only what a CIFAR batch holds; any other global in the pickle is refused."""

    # numpy 1 pickles name numpy.core, numpy 2 numpy._core; Python 3 pickles of bytes use _codecs.encode.
    _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
                ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a CIFAR-10 batch holds only "
                                         "dicts, lists, bytes and numpy arrays")
        if module.startswith("numpy.core.") and hasattr(np, "_core"):
            module = "numpy._core." + module[len("numpy.core."):]  # numpy 2 warns on numpy.core
        return super().find_class(module, name)
