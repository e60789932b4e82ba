"""The nodes' optimizer steps under fused execution: each node steps its own optimizer, with torch's fused kernel
where the optimizer left the implementation to torch.

The kernel makes one pass over parameter, gradient and state where torch's for-loop default makes about ten, one
per elementwise op: 32 MLP nodes' AdamW steps took 33.2 ms one per node with the for-loop, 13.3 ms one per node
with the fused kernel, and 11.0 ms as one call over all the nodes' tensors (one thread,
benchmarks/bench_fused_parts.py). That last step was once taken: it needed each node's `optim.step` replaced and
torch's private bookkeeping of the call written by hand, which this library does not do for 2.3 ms.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FUSED_KERNEL", "adopt_fused_kernel", "prefer_fused_kernel"]

FUSED_KERNEL = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # elementwise, with a fused kernel


def adopt_fused_kernel(model: torch.nn.Module, optim: Any) -> bool:
    """Switch a node's optimizer to the fused kernel where that is what fused runs do: one of FUSED_KERNEL over the
    node's own model parameters (not an outer model's), neither differentiable nor capturable. True if switched
    or already set by the user; False where it steps as it was built."""
    if type(optim) not in FUSED_KERNEL:
        return False
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for g in optim.param_groups for p in g["params"]):
        return False  # it also steps tensors outside the model (an outer model, extra parameters)
    if any(g.get("differentiable") or g.get("capturable") for g in optim.param_groups):
        return False
    prefer_fused_kernel(optim)
    return True


def prefer_fused_kernel(optim: torch.optim.Optimizer) -> None:
    """Step with torch's fused kernel (one pass over parameter, gradient and state) where the optimizer left the
    implementation to torch (foreach and fused both None), by setting the parameter groups' documented `fused`
    option. The fused kernel rounds differently from the for-loop (an ulp), which is why an optimizer that names
    its implementation keeps it, and why only fused runs switch."""
    groups = optim.param_groups
    if any(g.get("foreach") is not None or g.get("fused") is not None for g in groups):
        return
    if any(not p.is_floating_point() or p.device.type not in ("cpu", "cuda") for g in groups for p in g["params"]):
        return
    for g in groups:
        g["fused"] = True
    for p, state in optim.state.items():  # the fused kernels keep the step count on the parameter's device
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != p.device:
            state["step"] = step.to(p.device)
