"""How a node's forward/backward is executed: the node is given one Execution and never asks which.

`SequentialExecution` (the default, and the torch backend's) runs the node's own forward/backward on its own
module. The sim backend may give its nodes a fused one instead (exogym.backends.sim.fused.execution), which
batches the nodes computing in a step into one vmapped computation.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["Execution", "SequentialExecution", "StepResult", "EXECUTIONS", "FusedFallbackWarning", "StepFlops",
           "batch_signature"]

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


def batch_signature(batch: Any) -> tuple:
    """What a forward/backward's arithmetic depends on in `batch`: its structure, and each tensor leaf's shape and
    dtype (other leaves by value)."""
    leaves, spec = tree_flatten(batch)
    return (str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x))
                             for x in leaves))


class StepFlops:
    """The FLOPs of a step, counted once for the nodes that share an execution (a sim process's): nodes whose models
    have the same parameters' shapes and whose batches have the same signature do the same arithmetic (a node's own
    steps are counted once for the same reason). Counting costs a few forward/backwards' time."""

    def __init__(self) -> None:
        self._counted: dict[tuple, float] = {}

    def lookup(self, model: torch.nn.Module, batch: Any) -> tuple[tuple, float | None]:
        """(the key of `model` on `batch`, its FLOPs if counted already, else None)."""
        key = (tuple(tuple(p.shape) for p in model.parameters()), batch_signature(batch))
        return key, self._counted.get(key)

    def add(self, key: tuple, flops: float) -> float:
        self._counted[key] = flops
        return flops


class SequentialExecution:
    """Each node computes with its own module, one after another."""

    share_parameters = True

    def __init__(self) -> None:
        self.flops = StepFlops()

    def adopt_optimizer(self, rank: int, model: torch.nn.Module, optim: Any) -> None:
        pass

    def release(self, rank: int, model: torch.nn.Module) -> None:
        pass

    def forward_backward(self, node: Any, batch: Any, *, count_flops: bool, measure: bool) -> StepResult:
        flops = None
        if count_flops:  # on the node's first step (StepFlops)
            key, flops = self.flops.lookup(node.model, batch)
            if flops is None:
                with FlopCounterMode(display=False) as counter:
                    out = node.forward_backward(batch)
                return out, 0.0, self.flops.add(key, float(counter.get_total_flops()))
        started = time.perf_counter()
        out = node.forward_backward(batch)
        if measure and node.device.type == "cuda":
            torch.cuda.synchronize(node.device)
        return out, time.perf_counter() - started, flops
