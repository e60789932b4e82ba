"""Fused execution as the node sees it: its forward/backward and optimizer steps join the other nodes' in the
engine's batched computation (exogym.backends.sim.fused.engine)."""

from __future__ import annotations

from typing import Any

import torch

from exogym.backends.sim.fused.engine import FusedEngine
from exogym.engine.execution import StepFlops, StepResult

__all__ = ["FusedExecution"]


class FusedExecution:
    """The nodes' parameters are slots of the engine's stacked tensors: never shared between nodes."""

    share_parameters = False

    def __init__(self, engine: FusedEngine):
        self.engine = engine
        self.flops = StepFlops()

    def adopt_optimizer(self, rank: int, model: torch.nn.Module, optim: Any) -> None:
        self.engine.adopt_optimizer(rank, model, optim)  # torch's fused kernel where the choice was torch's

    def release(self, rank: int, model: torch.nn.Module) -> None:
        self.engine.release(rank, model)  # views into the stacks would pickle every node's slots

    def forward_backward(self, node: Any, batch: Any, *, count_flops: bool, measure: bool) -> StepResult:
        flops = None
        if count_flops:  # counted on a throwaway copy running the node's own arithmetic, once (StepFlops)
            key, flops = self.flops.lookup(node.model, batch)
            if flops is None:
                flops = self.flops.add(key, self.engine.count_flops(node.model,
                                                                    lambda m: node.forward_backward(batch, m)))
        out, seconds = self.engine.forward_backward(node.rank, node.step + 1, node.model, batch)
        return out, seconds, flops
