"""Nodes coming up (after a failure, or into an elastic pool) take the global state from a node that was up.

At the first step of nodes coming up, before anyone computes, the nodes that were up and define the
global model (Strategy.model_sources among them) build the joiner's model by the rule of
exogym.engine.global_model (the strategy's global entries, the rest averaged over the sources: a counted
all-reduce among them). The first source packs that model and its strategy's state (Strategy.state_dict:
the global part, and its local part as the joiner's best start: optimizer moments, schedule, step count)
and sends it by one broadcast to the joiners, who load it and then drop what was the sender's own
(Strategy.joined: residuals, corrections in flight). Real traffic, counted like any collective.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import torch

from exogym.engine.global_model import split_global_state
from exogym.comm.collectives import broadcast, get_rank
from exogym.comm.mean import mean_
from exogym.strategy.base import frozen_state

__all__ = ["hand_over_state"]


@torch.no_grad()
def hand_over_state(model: torch.nn.Module, strategy: Any, step: int, survivors: list[int],
                    joiners: list[int]) -> None:
    """Every node up at `step` calls this before computing it; `survivors` were up at the step before,
    `joiners` were not."""
    rank = get_rank()
    sources = strategy.model_sources(list(survivors), step - 1) or list(survivors)
    payload = None
    if rank in sources:
        state, averaged, _ = split_global_state(model, strategy)
        mean_([state[k] for k in averaged], group=sources)
        if rank == sources[0]:
            frozen = frozen_state(model)  # the same on every node from the start: never sent
            payload = _pack({"model": {k: v for k, v in state.items() if k not in frozen},
                             "strategy": strategy.state_dict()})
    if rank not in joiners and rank != sources[0]:
        return
    group = [sources[0], *joiners]
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(size, src=sources[0], group=group)
    buffer = payload if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(buffer, src=sources[0], group=group)
    if rank in joiners:
        received = _unpack(buffer)
        model.load_state_dict({**frozen_state(model), **received["model"]})
        strategy.load_state_dict(received["strategy"])
        strategy.joined()


def _pack(state: Any) -> torch.Tensor:
    out = io.BytesIO()
    torch.save(_canonical(state), out)
    return torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)


def _canonical(x: Any) -> Any:
    """The state rebuilt with fresh containers and interned strings: pickle writes a repeated object once, so
    without this the payload's size (the bytes counted) would depend on which equal strings and tuples happen to
    be one object, e.g. on whether the sender once loaded its state from another node or another process."""
    if isinstance(x, str):
        return sys.intern(x)
    if isinstance(x, dict):
        return {_canonical(k): _canonical(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_canonical(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_canonical(v) for v in x)
    return x


def _unpack(buffer: torch.Tensor) -> Any:
    # Tensors and plain data only (the state protocol), loaded on the CPU: load_state_dict copies them into
    # the joiner's own tensors, wherever they live.
    return torch.load(io.BytesIO(buffer.numpy().tobytes()), map_location="cpu", weights_only=True)
