"""Per-node random streams: torch (CPU and the node's CUDA device), Python `random`, numpy.

Each node's streams are seeded from (seed, rank) alone, so node 3's dropout masks do not
depend on how many nodes run or in which order the scheduler runs them. The sim backend
swaps a node's streams in when it gets the baton and out when it hands it on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["node_seed", "NodeRNG", "GlobalRNGState"]


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


class NodeRNG:
    """One node's streams: seeded on first activation, saved and restored with the baton."""

    def __init__(self, seed: int, device: torch.device, state: GlobalRNGState | None = None):
        self.seed, self.device = seed, device
        self._state = state  # a resumed node starts from its checkpointed streams

    def activate(self) -> None:
        if self._state is not None:
            self._state.restore()
            return
        torch.random.default_generator.manual_seed(self.seed)
        random.seed(self.seed)
        np.random.seed(self.seed % 2**32)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(self.seed)

    def deactivate(self) -> None:
        self._state = GlobalRNGState.capture(self.device)
