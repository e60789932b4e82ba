"""Pack many tensors into one flat buffer per dtype, so one collective moves them all (as DDP's buckets do)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

__all__ = ["flatten_by_dtype", "unflatten_into"]


def flatten_by_dtype(tensors: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """[(flat copy of the tensors of one dtype, those tensors)], in first-seen dtype order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[t.dtype].append(t)
    return [(torch.cat([t.reshape(-1) for t in ts]), ts) for ts in groups.values()]


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` back into `tensors` (the inverse of flatten_by_dtype)."""
    for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(chunk.view_as(t))
