"""DDP's replica, kept once: the parameters, the optimizer and the LR schedule every node holds identically.

Under DDP every node applies the same optimizer step to the same averaged gradient, so every node's
parameters and optimizer state are the same bits after every step. `replica_for(...)` gives every node of a
sim run the same `Replica` (NodeContext.keep_once): each node's module parameters become
views of the replica's storage (still each node's own Parameter objects, so each node's backward writes its
own .grad), and a step's update (clip, optimizer step, schedule step) is applied once, by the first node to
get there with the averaged gradient; the others find it done. K nodes then hold one model's parameters and
optimizer state, and a node's gradients live from its backward until they are flattened into the mean.
On torch.distributed each process holds its own replica (one node's), and the code path is the same.
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from exogym.strategy.lr_schedule import LRSchedule
from exogym.strategy.context import KeepOnce
from exogym.strategy.optim import OptimSpec

__all__ = ["Replica", "replica_for"]


class Replica:
    """One set of parameters (the first node's storage), its optimizer and LR schedule, and the count of steps
    applied to them."""

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, schedule: LRSchedule | None, max_steps: int):
        self.params = [torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in model.parameters()]
        self.optim = spec.build(self.params)
        self.scheduler = schedule.build(self.optim, max_steps=max_steps) if schedule is not None else None
        self.steps_applied = 0

    @torch.no_grad()
    def attach(self, model: torch.nn.Module) -> None:
        """Make `model`'s parameters views of the replica's (its own storage is freed). Every node's model is a
        copy of the one given to fit (or a checkpoint's, the same on every node), so only a node that is down
        can find the replica further on: it takes the survivors' state when it comes up anyway."""
        own = list(model.parameters())
        if [(p.shape, p.dtype) for p in own] != [(p.shape, p.dtype) for p in self.params]:
            raise RuntimeError("a DDP node's model has other parameters than the replica's; every node must train "
                               "a copy of the same model")
        for p, shared in zip(own, self.params):
            p.data = shared.data

    def apply_once(self, step: int, grads: list[torch.Tensor | None], update: Callable[[list], None]) -> bool:
        """The update of step `step` (counted from 0) with the averaged `grads` (one per parameter, None where a
        parameter has none), unless another node applied it already; True if this call applied it."""
        if step < self.steps_applied:
            return False
        if step > self.steps_applied:
            raise RuntimeError(f"DDP's replica has {self.steps_applied} steps applied, a node is at step {step + 1}")
        for p, g in zip(self.params, grads):
            p.grad = g
        try:
            update(self.params)
        finally:
            for p in self.params:
                p.grad = None
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps_applied += 1
        return True


def replica_for(keep_once: KeepOnce, key: Hashable, model: torch.nn.Module, make: Callable[[], Replica]) -> Replica:
    """The replica every node whose strategy shares `key` (and device) holds: one for the run in the sim, one
    per process on torch.distributed."""
    device = next(model.parameters()).device
    return keep_once(("ddp_replica", key, str(device)), make)

