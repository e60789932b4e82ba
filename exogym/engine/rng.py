"""Per-node random streams: torch (CPU and the node's CUDA device), Python `random`, numpy.

Each node's streams are seeded from (seed, rank) alone, so node 3's dropout masks do not
depend on how many nodes run or in which order the scheduler runs them. The sim backend
swaps a node's streams in when it gets the baton and out when it hands it on; numpy's process-wide stream
goes through numpy's public API only (NumpyBaton).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["node_seed", "NodeRNG", "NumpyBaton", "GlobalRNGState"]


def node_seed(seed: int, rank: int) -> int:
    """A well-mixed 63-bit seed for node `rank` of a run seeded with `seed`."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass
class GlobalRNGState:
    """A snapshot of the process-wide generators the training code draws from."""

    torch_cpu: torch.Tensor
    python: Any
    numpy: Any
    cuda: torch.Tensor | None = None
    cuda_device: torch.device | None = None

    @classmethod
    def capture(cls, device: torch.device | None = None) -> "GlobalRNGState":
        cuda = device if device is not None and device.type == "cuda" else None
        return cls(torch.get_rng_state(), random.getstate(), np.random.get_state(),
                   torch.cuda.get_rng_state(cuda) if cuda is not None else None, cuda)

    def to_plain(self) -> dict[str, Any]:
        """Tensors and plain data only (what a checkpoint may hold)."""
        kind, keys, pos, has_gauss, cached = self.numpy
        return {"torch_cpu": self.torch_cpu, "python": self.python,
                "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
                "cuda": self.cuda, "cuda_device": str(self.cuda_device) if self.cuda_device is not None else None}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> "GlobalRNGState":
        kind, keys, pos, has_gauss, cached = d["numpy"]
        version, internal, gauss = d["python"]
        return cls(d["torch_cpu"].cpu(), (version, tuple(internal), gauss),
                   (kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached),
                   d["cuda"].cpu() if d["cuda"] is not None else None,
                   torch.device(d["cuda_device"]) if d["cuda_device"] is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.cuda_device)


def _fresh_bit_generator(state: Any) -> Any:
    """A bit generator of the kind a public np.random.get_state() value `state` (tuple or dict) is for."""
    name = state[0] if isinstance(state, tuple) else state["bit_generator"]
    return getattr(np.random, name)()


_swap_checked: bool | None = None  # _swap_is_exact() for this process's numpy, once known


def _swap_is_exact() -> bool:
    """Whether numpy's public bit-generator hand-over does here all that NumpyBaton relies on, checked once against
    the legacy stream itself: get_bit_generator() returns the object set_bit_generator() installed, the stream's
    draws advance that object (no copy), installing one clears the legacy cached Gaussian, and re-installing an
    object continues its stream. numpy < 1.25 lacks the calls. The caller's stream (object, state and cached
    Gaussian) is put back as it was."""
    global _swap_checked
    if _swap_checked is not None:
        return _swap_checked
    if not (hasattr(np.random, "get_bit_generator") and hasattr(np.random, "set_bit_generator")):
        _swap_checked = False
        return False
    caller_bg, caller_state = np.random.get_bit_generator(), np.random.get_state(legacy=False)
    try:
        ref = np.random.RandomState(12345)  # the legacy stream on its own
        ref.standard_normal(3)  # three of a pair-wise method: one Gaussian left cached
        mine, other = np.random.MT19937(), np.random.MT19937()
        np.random.set_bit_generator(mine)
        np.random.seed(12345)
        np.random.standard_normal(3)
        ok = np.random.get_bit_generator() is mine and np.random.get_state(legacy=False)["has_gauss"] == 1
        np.random.set_bit_generator(other)
        ok = ok and np.random.get_state(legacy=False)["has_gauss"] == 0
        np.random.set_bit_generator(mine)
        ok = ok and np.random.get_state(legacy=False)["has_gauss"] == 0
        theirs, ours = ref.get_state(legacy=False)["state"], mine.state["state"]
        ok = ok and theirs["pos"] == ours["pos"] and np.array_equal(theirs["key"], ours["key"])
        ok = ok and np.array_equal(np.random.random_sample(5), ref.random_sample(5))
    except Exception:  # noqa: BLE001 - any surprise means: do not rely on it
        ok = False
    finally:
        np.random.set_bit_generator(caller_bg)
        np.random.set_state(caller_state)
    _swap_checked = bool(ok)
    return _swap_checked


class _NumpyStream:
    """One node's numpy stream between its turns."""

    __slots__ = ("bit_generator", "state")

    def __init__(self, state: Any = None):
        self.bit_generator: Any = None  # the node's own bit generator object (swap mode); None: make one
        self.state = state  # a public get_state() value to set at the node's next turn; None: nothing to set


class NumpyBaton:
    """numpy's process-wide legacy stream (np.random.*), handed from node to node through numpy's public API.

    Users' code draws from np.random's functions, which belong to one process-wide RandomState, so that stream
    is what must be swapped. np.random.get_state / set_state take about 30 us each (they copy the Mersenne
    Twister's 2.5 KB key element by element). Instead each node owns a bit generator object (an MT19937 seeded as
    np.random.seed seeds), installed at its turns with np.random.set_bit_generator, which copies nothing (under
    a microsecond). What the bit generator does not hold is the legacy RandomState's cached second Gaussian
    (has_gauss, gauss), which installing a bit generator clears: a node pausing reads it with
    np.random.get_state (the one state copy left per hand-over), and a node that paused with one cached gets it
    back with np.random.set_state. Between turns the bit generator installed is the one found before the first
    turn (the caller's), so whatever draws outside a node's turn moves no node's stream.

    What this relies on beyond the documented calls is checked once per process (_swap_is_exact); where it does
    not hold, as on numpy < 1.25, every hand-over uses get_state / set_state. `swap=False` asks for that."""

    def __init__(self, swap: bool | None = None):
        self.swap = _swap_is_exact() if swap is None else (swap and _swap_is_exact())
        self._parked: Any = None  # the bit generator installed between turns (swap mode)

    def enter(self, stream: _NumpyStream, seed: int | None = None) -> None:
        """Install a node's stream as np.random's; `seed`: instead seed it as np.random.seed(seed) does."""
        if not self.swap:
            if seed is not None:
                np.random.seed(seed)
            else:
                np.random.set_state(stream.state)
            return
        if self._parked is None:
            self._parked = np.random.get_bit_generator()
        if stream.bit_generator is None:
            stream.bit_generator = np.random.MT19937() if seed is not None else _fresh_bit_generator(stream.state)
        np.random.set_bit_generator(stream.bit_generator)  # its twister state, by reference; no cached Gaussian
        if seed is not None:
            np.random.seed(seed)
        elif stream.state is not None:
            np.random.set_state(stream.state)  # a cached Gaussian (or a resumed node's first turn)
        stream.state = None

    def leave(self, stream: _NumpyStream) -> None:
        """Take a node's stream out of np.random at the end of its turn."""
        if not self.swap:
            stream.state = np.random.get_state()
            return
        installed = np.random.get_bit_generator()
        state = np.random.get_state(legacy=False)
        np.random.set_bit_generator(self._parked)
        if installed is not stream.bit_generator:  # the node installed one of its own: keep its state, not it
            stream.bit_generator, stream.state = None, state
        elif state["has_gauss"]:
            stream.state = state  # its key is the node's bit generator's, which nothing draws from until its turn


class NodeRNG:
    """One node's streams: seeded on first activation, saved and restored with the baton."""

    def __init__(self, seed: int, device: torch.device, state: GlobalRNGState | None = None,
                 baton: NumpyBaton | None = None):
        self.seed, self.device = seed, device
        self._state = state  # torch's, Python's (and CUDA's) at the last pause; a resumed node: its checkpoint's
        self._baton = baton or NumpyBaton()
        self._numpy = _NumpyStream(state.numpy if state is not None else None)

    def activate(self) -> None:
        s = self._state
        if s is None:
            torch.random.default_generator.manual_seed(self.seed)
            random.seed(self.seed)
            self._baton.enter(self._numpy, seed=self.seed % 2**32)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(self.seed)
            return
        torch.set_rng_state(s.torch_cpu)
        random.setstate(s.python)
        if s.cuda is not None:
            torch.cuda.set_rng_state(s.cuda, s.cuda_device)
        self._baton.enter(self._numpy)

    def deactivate(self) -> None:
        cuda = self.device if self.device.type == "cuda" else None
        self._baton.leave(self._numpy)
        self._state = GlobalRNGState(torch.get_rng_state(), random.getstate(), None,  # numpy's: self._numpy
                                     torch.cuda.get_rng_state(cuda) if cuda is not None else None, cuda)
