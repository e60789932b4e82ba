"""The idx format of the original MNIST distribution (also Fashion-MNIST's): a big-endian header, then uint8 data.

Header: a 4-byte magic number (two zero bytes, 0x08 for unsigned bytes, then the number of dimensions),
then one 4-byte size per dimension: 16 header bytes for an image file [N, 28, 28], 8 for a label file [N].
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

__all__ = ["IMAGES_MAGIC", "LABELS_MAGIC", "read_idx", "idx_bytes"]

IMAGES_MAGIC, LABELS_MAGIC = 0x803, 0x801  # 0x08 = unsigned byte, then the number of dimensions


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array in an idx file (gzipped when the name ends in .gz), checked against `magic` and its header.

    Args:
        path: The idx file.
        magic: The magic number expected (`IMAGES_MAGIC` or `LABELS_MAGIC`).

    Returns:
        The array, `[N]` or `[N, H, W]`.

    Raises:
        RuntimeError: Another magic number, or a header that does not match the data.
    """
    path = Path(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        data = f.read()
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        raise RuntimeError(f"{path} starts with magic number {found:#x}, expected {magic:#x} "
                           f"(an idx {'image' if magic == IMAGES_MAGIC else 'label'} file); check the file name")
    dims = magic & 0xFF
    header = 4 + 4 * dims  # 16 bytes for images, 8 for labels
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    if len(data) - header != int(np.prod(shape)):
        raise RuntimeError(f"{path}: header says shape {shape} ({int(np.prod(shape))} bytes) but "
                           f"{len(data) - header} bytes follow it; the file is truncated or corrupt")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


def idx_bytes(array: np.ndarray) -> bytes:
    """A uint8 array `[N]` or `[N, H, W]` as the bytes of an idx file (what `read_idx` reads back).

    Args:
        array: The array.

    Returns:
        The file's bytes.
    """
    if array.dtype != np.uint8 or array.ndim not in (1, 3):
        raise ValueError(f"an idx file here holds uint8 labels [N] or images [N, H, W], got {array.dtype} "
                         f"{list(array.shape)}")
    magic = LABELS_MAGIC if array.ndim == 1 else IMAGES_MAGIC
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + np.ascontiguousarray(array).tobytes()
