"""Nodes coming up (after a failure, or into an elastic pool) take the global state from a node that was up.

At the first step of nodes coming up, before anyone computes, the nodes that were up and define the
global model (Strategy._model_sources: all of them, averaged, or one when every replica is the same)
build the state a joiner needs (Strategy._state_for_joiners); the first of them packs it into bytes and
sends it by one broadcast to the joiners, who load it. Real traffic, counted like any collective: a
node coming back downloads the model and the optimizer state.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from exogym.strategy.communicate import broadcast, get_rank

__all__ = ["hand_over_state"]


@torch.no_grad()
def hand_over_state(strategy: Any, step: int, survivors: list[int], joiners: list[int]) -> None:
    """Every node up at `step` calls this before computing it; `survivors` were up at the step before,
    `joiners` were not."""
    rank = get_rank()
    sources = strategy._model_sources(list(survivors), step - 1)
    payload = None
    if rank in sources:
        state = strategy._state_for_joiners(sources)
        if rank == sources[0]:
            payload = _pack(state)
    if rank not in joiners and rank != sources[0]:
        return
    group = [sources[0], *joiners]
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(size, src=sources[0], group=group)
    buffer = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(buffer, src=sources[0], group=group)
    if rank in joiners:
        strategy._load_state_from_survivor(_unpack(buffer))


def _pack(state: Any) -> torch.Tensor:
    out = io.BytesIO()
    torch.save(state, out)
    return torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)


def _unpack(buffer: torch.Tensor) -> Any:
    # Loaded on the CPU: load_state_dict copies into the joiner's own tensors, wherever they live.
    return torch.load(io.BytesIO(buffer.numpy().tobytes()), map_location="cpu", weights_only=False)
