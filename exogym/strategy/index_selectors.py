"""Which entries SPARTA averages: the original EXO Gym's index selectors, and the shared random streams that make
every node pick the same entries without sending them (exogym.strategy.sparta.SparseCommunicator uses both; the
selectors import from exogym.strategy.sparta, as in the original)."""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any, Iterator

import numpy as np
import torch

from exogym._validation import check_number

__all__ = ["IndexSelector", "RandomIndexSelector", "ShuffledSequentialIndexSelector", "PartitionedIndexSelector",
           "shared_random", "flat_indices", "num_parts", "partition_part", "shuffled_window", "shuffled_permutation",
           "SELECTOR_MODES"]

_PARTITIONED, _SHUFFLED, _SELECTOR = 5, 7, 8  # salts of the shared random streams (sparta.py has the others)


def _parameter_generator(seed: int, salt: int, cycle: int, index: int) -> torch.Generator:
    """A CPU generator every node seeds identically for (seed, purpose, cycle, parameter index)."""
    mixed = np.random.SeedSequence([seed, salt, cycle, index]).generate_state(1, dtype=np.uint64)[0] >> 1
    return torch.Generator().manual_seed(int(mixed))


def partition_part(seed: int, index: int, n: int, p: float, t: int) -> torch.Tensor:
    """The partitioned mode's entries of parameter `index` (n entries) at averaging t: part t mod P of a random
    partition into P = min(ceil(1/p), n) parts, a new partition each cycle of P."""
    parts = min(num_parts(p, n), n)
    cycle, part = divmod(t, parts)
    perm = torch.randperm(n, generator=_parameter_generator(seed, _PARTITIONED, cycle, index))
    return perm[part::parts].clone()


def shuffled_window(perm: torch.Tensor, p: float, t: int) -> torch.Tensor:
    """Window t mod P of a fixed permutation `perm` of n entries: P = ceil(1/p) windows of n // P entries, the
    first n mod P of them one longer, so together they cover every entry once."""
    n = perm.numel()
    parts = num_parts(p, n)
    w = t % parts
    size, extra = divmod(n, parts)
    start = w * size + min(w, extra)
    return perm[start:start + size + (w < extra)]


def shuffled_permutation(seed: int, index: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=_parameter_generator(seed, _SHUFFLED, 0, index))


def num_parts(p: float, n: int) -> int:
    """Parts of an n-entry parameter for the partitioned and shuffled-sequential modes: ceil(1/p), as the
    original EXO Gym (each step averages at most a fraction p); the partitioned mode caps it at n."""
    return max(1, math.ceil(1 / p - 1e-9))  # 1e-9: 1/p of a decimal p such as 0.1 may land a hair above 10


@contextlib.contextmanager
def shared_random(seed: int, iteration: int, index: int, device: torch.device | None = None) -> Iterator[None]:
    """Within it, torch's (CPU, and `device`'s when a GPU), numpy's and Python's global random streams are seeded
    from (seed, iteration, index) alone: the same on every node. The node's own streams are restored after."""
    mixed = int(np.random.SeedSequence([seed, _SELECTOR, iteration, index]).generate_state(1, dtype=np.uint64)[0] >> 1)
    gpus = [device] if device is not None and device.type == "cuda" else []
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=gpus, device_type="cuda"):
        torch.manual_seed(mixed)
        np.random.seed(mixed % 2**32)
        random.seed(mixed)
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def flat_indices(picked: Any, param: torch.Tensor, selector: Any) -> torch.Tensor:
    """A selector's answer, a bool mask of the parameter's shape or 1-D integer indices, as flat CPU int64 indices."""
    if isinstance(picked, torch.Tensor) and picked.dtype == torch.bool and picked.shape == param.shape:
        return picked.reshape(-1).nonzero().squeeze(1).cpu()
    if isinstance(picked, torch.Tensor) and picked.dim() == 1 and not picked.is_floating_point() \
            and picked.dtype != torch.bool:
        flat = picked.to("cpu", torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= param.numel()):
            raise ValueError(f"{type(selector).__name__}.get_indices returned indices outside 0..{param.numel() - 1} "
                             f"for a parameter of shape {tuple(param.shape)}")
        return flat
    got = (f"a {picked.dtype} tensor of shape {tuple(picked.shape)}" if isinstance(picked, torch.Tensor)
           else repr(picked))
    raise TypeError(f"{type(selector).__name__}.get_indices must return a bool mask of the parameter's shape "
                    f"{tuple(param.shape)} or 1-D integer indices, got {got}")


class IndexSelector:
    """Which entries of a parameter SPARTA averages (the original EXO Gym's extension point): subclass it and
    implement `get_indices(param, iteration)`, returning a bool mask of `param`'s shape (or 1-D flat indices) for
    the iteration-th averaging (0, 1, ...); `SparseCommunicator(selector)` then averages those entries.

    The communicator calls it on every node with torch's, numpy's and Python's random streams seeded the same
    (`shared_random`: from its seed, the iteration and the parameter's index), so every node picks the same
    entries and no mask is sent: only the values, counted as every all-reduce is. What a selector keeps between
    calls (`self.state`) is each node's own and is not checkpointed: derive it from those draws so that a resumed
    or rejoining node gets it back. The base class selects every entry.
    """

    def __init__(self, p: float):
        check_number("p", p, minimum=0.0, maximum=1.0)
        self.p = p
        self.state: dict[Any, Any] = {}

    def get_indices(self, param: torch.Tensor, iteration: int) -> torch.Tensor:
        return torch.ones_like(param, dtype=torch.bool)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.p!r})"

    def _index(self, param: torch.Tensor) -> int:
        """A parameter's index for a selector used on its own (in the order first seen)."""
        return self.state.setdefault(("index", id(param)), len(self.state))


class RandomIndexSelector(IndexSelector):
    """Each entry with probability p (a Bernoulli mask from torch's random stream: under SparseCommunicator, the
    same on every node; on its own, the calling node's, as the original's, whose scripts broadcast rank 0's mask)."""

    def get_indices(self, param: torch.Tensor, iteration: int) -> torch.Tensor:
        return torch.bernoulli(torch.full(param.shape, self.p, device=param.device)).bool()


class ShuffledSequentialIndexSelector(IndexSelector):
    """A fixed random permutation of each parameter's entries cut into ceil(1/p) windows, walked one per averaging:
    SparseCommunicator(this) is sparsification_mode="shuffled_sequential" with p_sparta=p, exactly. On its own
    (seed 0, parameters indexed in the order first seen) it gives the same windows as the communicator's seed 0."""

    def get_indices(self, param: torch.Tensor, iteration: int) -> torch.Tensor:
        index, n = self._index(param), param.numel()
        perm = self.state.setdefault(("permutation", index, n), shuffled_permutation(0, index, n))
        return _mask(shuffled_window(perm, self.p, iteration), param)


class PartitionedIndexSelector(IndexSelector):
    """A random partition of each parameter's entries into min(ceil(1/p), n) parts, one part per averaging and a new
    partition each cycle: SparseCommunicator(this) is sparsification_mode="partitioned" with p_sparta=p, exactly.
    On its own (seed 0, parameters indexed in the order first seen) it gives the communicator's seed-0 parts."""

    def get_indices(self, param: torch.Tensor, iteration: int) -> torch.Tensor:
        return _mask(partition_part(0, self._index(param), param.numel(), self.p, iteration), param)


def _mask(indices: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(param.numel(), dtype=torch.bool)
    mask[indices] = True
    return mask.view(param.shape).to(param.device)

# The built-in selectors SparseCommunicator runs as its modes (their exact classes: a subclass is asked itself).
SELECTOR_MODES = {ShuffledSequentialIndexSelector: "shuffled_sequential", PartitionedIndexSelector: "partitioned"}
