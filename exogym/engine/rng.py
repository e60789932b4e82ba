"""Per-node random streams: torch (CPU and the node's CUDA device), Python `random`, numpy.

Each node's streams are seeded from (seed, rank) alone, so node 3's dropout masks do not
depend on how many nodes run or in which order the scheduler runs them. The sim backend
swaps a node's streams in when it gets the baton and out when it hands it on.
"""

from __future__ import annotations

import ctypes
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


class NumpyBaton:
    """What the nodes of one run know of numpy's process-wide legacy stream between hand-overs.

    np.random.get_state / set_state take about 35 us each, most of a baton hand-over (a fused step of 32 nodes
    hands over about 100 times). The stream's Mersenne Twister state is 2.5 KB of plain memory, which a node
    can copy in and out in a microsecond; what that misses is the cached second Gaussian of the legacy
    RandomState (has_gauss), reachable only through set_state. So a node's copy is used only where the cache is
    known to be empty on both sides: the node's own state has none, and the node paused last left none."""

    _BYTES = 624 * 4 + 4  # mt19937_state: key[624] (uint32) and pos (int)

    def __init__(self):
        self.gauss_clear = False  # the node paused last left no cached Gaussian (nothing known yet)

    @staticmethod
    def _address() -> int:
        return np.random.mtrand._rand._bit_generator.ctypes.state_address

    def read(self) -> bytes:
        return ctypes.string_at(self._address(), self._BYTES)

    def write(self, raw: bytes) -> None:
        ctypes.memmove(self._address(), raw, self._BYTES)


class NodeRNG:
    """One node's streams: seeded on first activation, saved and restored with the baton."""

    def __init__(self, seed: int, device: torch.device, state: GlobalRNGState | None = None,
                 baton: NumpyBaton | None = None):
        self.seed, self.device = seed, device
        self._state = state  # a resumed node starts from its checkpointed streams
        self._baton = baton or NumpyBaton()
        self._numpy_raw: bytes | None = None  # the twister's bytes of self._state.numpy

    def activate(self) -> None:
        s = self._state
        if s is None:
            torch.random.default_generator.manual_seed(self.seed)
            random.seed(self.seed)
            np.random.seed(self.seed % 2**32)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(self.seed)
            return
        torch.set_rng_state(s.torch_cpu)
        random.setstate(s.python)
        if s.cuda is not None:
            torch.cuda.set_rng_state(s.cuda, s.cuda_device)
        if self._numpy_raw is not None and s.numpy[3] == 0 and self._baton.gauss_clear:
            self._baton.write(self._numpy_raw)
        else:
            np.random.set_state(s.numpy)
            self._numpy_raw = self._baton.read()

    def deactivate(self) -> None:
        cuda = self.device if self.device.type == "cuda" else None
        raw = self._baton.read()
        s = self._state
        if s is not None and raw == self._numpy_raw and s.numpy[3] == 0:
            numpy_state = s.numpy  # nothing drawn from numpy since activation: its state is the one saved
        else:
            numpy_state, self._numpy_raw = np.random.get_state(), raw
        self._state = GlobalRNGState(torch.get_rng_state(), random.getstate(), numpy_state,
                                     torch.cuda.get_rng_state(cuda) if cuda is not None else None, cuda)
        self._baton.gauss_clear = numpy_state[3] == 0
