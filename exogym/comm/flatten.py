"""Pack many tensors into one flat buffer per dtype, so one collective moves them all (as DDP's buckets do)."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch

__all__ = ["flatten_by_dtype", "unflatten_into", "flat_views", "flat_base", "flatten_in_place"]


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


def flat_views(shapes_like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Uninitialised tensors shaped like `shapes_like`, as consecutive views of one flat buffer (when they share a
    dtype and device): a reduction can then send that buffer as it is, without a flattened copy."""
    if not shapes_like or len({(t.dtype, t.device) for t in shapes_like}) > 1:
        return [torch.empty_like(t) for t in shapes_like]
    flat = torch.empty(sum(t.numel() for t in shapes_like), dtype=shapes_like[0].dtype, device=shapes_like[0].device)
    return [chunk.view_as(t) for t, chunk in zip(shapes_like, flat.split([t.numel() for t in shapes_like]))]


def flat_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D buffer `tensors` are consecutive views of, covering it exactly (as flat_views makes), or None."""
    base = tensors[0]._base if tensors else None
    if base is None or base.dim() != 1 or not base.is_contiguous():
        return None
    offset = 0
    for t in tensors:
        if t._base is not base or t.storage_offset() != base.storage_offset() + offset or not t.is_contiguous():
            return None
        offset += t.numel()
    return base if offset == base.numel() else None


@torch.no_grad()
def flatten_in_place(params: list[torch.Tensor]) -> torch.Tensor | None:
    """Make `params` consecutive views of one new flat buffer, their values kept (the same Parameter objects, so an
    optimizer built over them is unaffected), and return the buffer: their flattened copy is then the buffer itself.
    None, and nothing changed, when they differ in dtype or device.

    Args:
        params: The parameters (their `.data` is replaced).

    Returns:
        The 1-D buffer, or None.
    """
    if not params or len({(p.dtype, p.device) for p in params}) > 1:
        return None
    views = flat_views(params)
    for p, view in zip(params, views):
        view.copy_(p)
        p.data = view
    return views[0]._base
