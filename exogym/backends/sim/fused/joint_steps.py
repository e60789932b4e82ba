"""The nodes' optimizer steps under fused execution: SGD, Adam and AdamW steps of many nodes taken in one call.

A node's `optim.step()` parks it (like its forward/backward); when no node can run, the parked steps are grouped
by what must be equal for one call to step them all (class, parameter groups, hyperparameters, which parameters
have gradients and state) and each group takes one step of its class over every member's own tensors,
each tensor stepped on its own as in the member's own step: the bits are those of one step per node
(tests/test_fused.py compares them). Anything else (a closure, step hooks, a mismatch) steps each node's own
optimizer, as without fusing.

Where the optimizer leaves its implementation to torch, fused execution switches it to torch's fused kernel
(`prefer_fused_kernel`): one pass over parameter, gradient and state instead of one per elementwise op, and one
kernel call for the group. Not over [K, ...] stacks: the kernel's vectorised body and its scalar tail round
differently, so an entry's bits would depend on where its node's slice starts in a stacked tensor (seen with
15-entry tensors of 4 nodes); and stacking the for-loop implementation saves little (32 MLP nodes: 20.7 ms
stacked, 20.5 ms a step per node, 6.3 ms with the fused kernel; benchmarks/bench_fused_parts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from exogym.backends.sim.fused.stacked import NodeStacks

__all__ = ["JointSteps", "JOINABLE", "prefer_fused_kernel"]

JOINABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # elementwise, with a fused kernel


@dataclass
class StepWork:
    """A node's parked optimizer step."""

    rank: int
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    step: Callable[[], Any]  # the optimizer's own step (a fallback steps with it)


class JointSteps:
    """The nodes' adopted optimizers and their steps taken together."""

    def __init__(self, stacks: NodeStacks):
        self.stacks = stacks
        self._names: dict[int, dict[int, str]] = {}  # rank -> id(parameter) -> its name in the stacks
        self._proxies: dict[type, torch.optim.Optimizer] = {}  # per class, one optimizer whose step takes a group
        self.steps_together = 0  # groups stepped in one call (for tests and reports)

    def register(self, rank: int, model: torch.nn.Module, optim: Any) -> bool:
        """Whether node `rank`'s optimizer can step with the others (one of JOINABLE, over the node's own model
        parameters); if so, note where its parameters are in the stacks."""
        if type(optim) not in JOINABLE:
            return False
        names = {id(p): n for n, p in model.named_parameters() if n in self.stacks.param_shapes}
        if any(id(p) not in names for g in optim.param_groups for p in g["params"]):
            return False  # it also steps tensors outside the model (an outer model, extra parameters)
        if any(g.get("differentiable") or g.get("capturable") for g in optim.param_groups):
            return False
        self._names[rank] = names
        return True

    def adopt(self, rank: int, model: torch.nn.Module, optim: Any, park: Callable[[StepWork], None]) -> bool:
        """Route node `rank`'s `optim.step()` through `park` when it can step with the others (`register`);
        False: it steps on its own."""
        if getattr(optim, "_exogym_parked", False) or not self.register(rank, model, optim):
            return False
        prefer_fused_kernel(optim)
        own_step = optim.step  # the class's step, or the LR scheduler's wrapper of it (which notes the call)

        def parked_step(closure: Callable[[], Any] | None = None) -> Any:
            if closure is not None:
                return own_step(closure)
            park(StepWork(rank, model, optim, own_step))
            return None

        optim.step = parked_step  # type: ignore[method-assign]
        optim._exogym_parked = True
        return True

    # --- the batched side ----------------------------------------------------------------------------
    def run(self, works: list[StepWork]) -> None:
        groups: dict[Any, list[StepWork]] = {}
        for w in sorted(works, key=lambda w: w.rank):
            key = self._signature(w)
            groups.setdefault(key if key is not None else ("alone", w.rank), []).append(w)
        for key, group in groups.items():
            if key[0] == "alone" or len(group) == 1:
                for w in group:
                    w.step()
            else:
                self._step_together(group)

    def _signature(self, w: StepWork) -> tuple | None:
        """What must be equal for nodes to step together; None: this node steps alone."""
        opt = w.optim
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_optimizer_pre_hooks \
                or _global_optimizer_post_hooks:
            return None
        names = self._names[w.rank]
        groups = []
        for g in opt.param_groups:
            hyper = tuple(sorted((k, _frozen(v)) for k, v in g.items() if k != "params"))
            params = []
            for p in g["params"]:
                state = opt.state.get(p, {})
                params.append((names[id(p)], p.grad is not None, tuple(sorted(state))))
            groups.append((hyper, tuple(params)))
        # Step counts need not agree: every implementation reads each tensor's own (a node back from a failure
        # steps with the others).
        return (type(opt), tuple(groups))

    @torch.no_grad()
    def _step_together(self, group: list[StepWork]) -> None:
        """One step of the members' optimizer class over every member's own tensors (one kernel call under the
        fused kernel); the state stays where each node keeps it."""
        first = group[0].optim
        proxy = self._proxies.get(type(first))
        if proxy is None:  # built once per class (an optimizer's constructor took ~0.4 ms): its groups are replaced
            proxy = self._proxies[type(first)] = type(first)([{"params": [torch.zeros(1)]}])
        proxy.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                               "params": [p for w in group for p in w.optim.param_groups[gi]["params"]]}
                              for gi, g in enumerate(first.param_groups)]
        for w in group:
            proxy.state.update(w.optim.state)  # each entry is the node's own state dict, stepped in place
        held = len(proxy.state)
        try:
            type(first).step(proxy)
            if len(proxy.state) > held:  # a first step made state in the proxy: hand it to the nodes' optimizers
                for w in group:
                    for g in w.optim.param_groups:
                        for p in g["params"]:
                            if p in proxy.state:
                                w.optim.state[p] = proxy.state[p]
        finally:
            proxy.state.clear()  # holds no node's tensors between steps
            proxy.param_groups = []
        for w in group:
            w.optim._opt_called = True  # what the LR scheduler's wrapper of step() notes
        self.steps_together += 1


def prefer_fused_kernel(optim: torch.optim.Optimizer) -> None:
    """Step with torch's fused kernel (one pass over parameter, gradient and state) where the optimizer left the
    implementation to torch (foreach and fused both None). torch's for-loop default makes about ten passes, one
    per elementwise op: 32 MLP nodes' AdamW steps took 20.5 ms that way and 6.3 ms fused (one thread,
    benchmarks/bench_fused_parts.py). The node's own optimizer is switched, so a node stepping
    alone takes the same kernel; the fused kernel rounds differently from the for-loop (an ulp), which is why an
    optimizer that names its implementation keeps it."""
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


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.item()) if value.numel() == 1 else ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value
