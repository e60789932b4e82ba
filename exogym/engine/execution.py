"""How a node's forward/backward is executed: the node is given one Execution and never asks which.

`SequentialExecution` (the default, and the torch backend's) runs the node's own forward/backward on its own
module. The sim backend may give its nodes a fused one instead (exogym.backends.sim.fused.execution), which
batches the nodes computing in a step into one vmapped computation.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["Execution", "SequentialExecution", "StepResult", "EXECUTIONS", "FusedFallbackWarning"]

# fit's execution=: what the configuration checks before anything else; a backend decides which one runs
# (ProcessBackend.choose_execution).
EXECUTIONS = ("sequential", "fused", "auto")


class FusedFallbackWarning(UserWarning):
    """execution="auto" runs the nodes sequentially (the message says why)."""

StepResult = tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], float, "float | None"]


class Execution(Protocol):
    """share_parameters: whether the nodes' parameters may be views of one storage (DDP's one replica).
    `node` below is the TrainNode asking (its rank, step, model, device and own `forward_backward`)."""

    share_parameters: bool

    def adopt_optimizer(self, rank: int, model: torch.nn.Module, optim: Any) -> None:
        """Once, after the node's strategy is set up (and its state loaded): take over its optimizer's steps."""

    def release(self, rank: int, model: torch.nn.Module) -> None:
        """Give the node's tensors storage of their own before its state is read whole (checkpoint, hand-over)."""

    def forward_backward(self, node: Any, batch: Any, *, count_flops: bool, measure: bool) -> StepResult:
        """The node's forward/backward on `batch`: ((loss, metrics), seconds it took, its FLOPs if count_flops).
        measure: the seconds are the run's simulated compute time (wait for the device before reading the clock)."""


class SequentialExecution:
    """Each node computes with its own module, one after another."""

    share_parameters = True

    def adopt_optimizer(self, rank: int, model: torch.nn.Module, optim: Any) -> None:
        pass

    def release(self, rank: int, model: torch.nn.Module) -> None:
        pass

    def forward_backward(self, node: Any, batch: Any, *, count_flops: bool, measure: bool) -> StepResult:
        if count_flops:  # counted once, on the first step: every step of a node does the same arithmetic
            with FlopCounterMode(display=False) as counter:
                out = node.forward_backward(batch)
            return out, 0.0, float(counter.get_total_flops())
        started = time.perf_counter()
        out = node.forward_backward(batch)
        if measure and node.device.type == "cuda":
            torch.cuda.synchronize(node.device)
        return out, time.perf_counter() - started, None
