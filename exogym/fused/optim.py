"""Stacked optimizer steps under fused execution: the nodes' SGD, Adam and AdamW steps taken at once.

These optimizers are elementwise: an entry's update reads only that entry's parameter, gradient and state and
the step's scalars (lr, betas, the step count). A node's `optim.step()` parks it (like its forward/backward);
when no node can run, the parked steps are grouped by what makes them stackable (class, parameter groups,
hyperparameters, which parameters have gradients, the step counts) and each group takes one step. Anything else
(a closure, step hooks, a mismatch) steps each node's own optimizer, as without fusing.

Two ways, both exact (tests/test_fused.py compares the bits with one step per node):
- torch's fused kernel (`fused=True`; chosen for an optimizer that leaves the implementation to torch, see
  `prefer_fused_kernel`): one call over every member's own tensors, state where each node keeps it. Not over
  stacked tensors: the kernel's vectorised body and scalar tail round differently, so an entry's bits would
  depend on where its node's slice starts.
- the for-loop or foreach implementations (an optimizer that names one): one step over [M, ...] stacks of
  parameters, gradients and state, the same arithmetic entry by entry as M steps. Every per-entry state tensor
  (Adam's moments, SGD's momentum) is kept in one [K, ...] stack per parameter and key, and node r's optimizer
  state holds views of slot r, as its parameters do (exogym.fused.stacked). A state tensor that is not its
  slot's view (loaded from a checkpoint, handed over by a survivor) is copied in before the step; `release`
  gives a node's state storage of its own before it is pickled. The step count stays each node's own tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from exogym.fused.stacked import NodeStacks

__all__ = ["StackedOptimizers", "STACKABLE", "prefer_fused_kernel"]

STACKABLE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@dataclass
class StepWork:
    """A node's parked optimizer step."""

    rank: int
    model: torch.nn.Module
    optim: torch.optim.Optimizer
    step: Callable[[], Any]  # the optimizer's own step (a fallback steps with it)


class StackedOptimizers:
    """The nodes' adopted optimizers, their stacked state, and the stacked steps."""

    def __init__(self, stacks: NodeStacks):
        self.stacks = stacks
        self.state: dict[tuple[str, str], torch.Tensor] = {}  # (parameter, state key) -> [K, ...]
        self._names: dict[int, dict[int, str]] = {}  # rank -> id(parameter) -> its name in the stacks
        self.stacked_steps = 0  # groups stepped at once (for tests and reports)

    def register(self, rank: int, model: torch.nn.Module, optim: Any) -> bool:
        """Whether node `rank`'s optimizer can step with the others (one of STACKABLE, over the node's own model
        parameters); if so, note where its parameters are in the stacks."""
        if type(optim) not in STACKABLE:
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

    def release(self, rank: int, optim: Any) -> None:
        """Give node `rank`'s state tensors storage of their own (before pickling: a view pickles the stack)."""
        if optim is None or not getattr(optim, "_exogym_parked", False):
            return
        for state in optim.state.values():
            for key, t in list(state.items()):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                    state[key] = t.clone()

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
                self._step_stacked(group)

    def _signature(self, w: StepWork) -> tuple | None:
        """What must be equal for nodes to step together; None: this node steps alone."""
        opt = w.optim
        if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks or _global_optimizer_pre_hooks \
                or _global_optimizer_post_hooks:
            return None
        names = self._names[w.rank]
        groups, steps = [], []
        for g in opt.param_groups:
            hyper = tuple(sorted((k, _frozen(v)) for k, v in g.items() if k != "params"))
            params = []
            for p in g["params"]:
                state = opt.state.get(p, {})
                params.append((names[id(p)], p.grad is not None, tuple(sorted(state))))
                steps.append(state.get("step"))
            groups.append((hyper, tuple(params)))
        return (type(opt), tuple(groups), _step_counts(steps))

    @torch.no_grad()
    def _step_stacked(self, group: list[StepWork]) -> None:
        if group[0].optim.param_groups[0].get("fused"):
            return self._step_listed(group)
        members = [w.rank for w in group]
        for w in group:
            self.stacks.sync(w.rank, w.model)  # parameters are their slots' views (a rebound one is copied in)
        params, _, copied = self.stacks.gather(members)
        first = group[0].optim
        stacked_groups, written_back = [], []
        proxy_state: dict[torch.Tensor, dict[str, Any]] = {}
        for gi, g in enumerate(first.param_groups):
            tensors = []
            for pi, p in enumerate(g["params"]):
                name = self._names[group[0].rank][id(p)]
                own = [w.optim.param_groups[gi]["params"][pi] for w in group]
                if own[0].grad is None:
                    continue  # no node has a gradient for it (the signatures agree): the optimizer skips it
                stacked = params[name]
                stacked.grad = _stack([q.grad for q in own])
                proxy_state[stacked] = self._gather_state(name, members, [w.optim.state.get(q, {}) for w, q in
                                                                           zip(group, own)])
                tensors.append(stacked)
                written_back.append((name, stacked, own))
            stacked_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": tensors})
        proxy = type(first)([{"params": [torch.zeros(1)]}])  # replaced below: its class's step on the stacks
        proxy.param_groups = stacked_groups
        for t, state in proxy_state.items():
            proxy.state[t] = state
        type(first).step(proxy)
        for name, stacked, own in written_back:
            self._scatter_state(name, members, proxy.state[stacked], [w.optim for w in group], own)
            stacked.grad = None
        if copied:
            for name, t in params.items():
                self.stacks.params[name].index_copy_(0, torch.tensor(members, device=t.device), t)
        for w in group:
            w.optim._opt_called = True  # what the LR scheduler's wrapper of step() notes
        self.stacked_steps += 1

    def _step_listed(self, group: list[StepWork]) -> None:
        """torch's fused kernel over every member's own tensors at once: one call, each tensor stepped on its own.
        Not over the stacks: the kernel's vectorised body and its scalar tail round differently, so where a
        node's entries fall in a stacked tensor would move bits (measured: 15-entry tensors of 4 nodes)."""
        first = group[0].optim
        proxy = type(first)([{"params": [torch.zeros(1)]}])  # replaced below: its class's step on the lists
        proxy.param_groups = [{**{k: v for k, v in g.items() if k != "params"},
                               "params": [p for w in group for p in w.optim.param_groups[gi]["params"]]}
                              for gi, g in enumerate(first.param_groups)]
        for w in group:
            proxy.state.update(w.optim.state)
        type(first).step(proxy)
        for w in group:  # state made on a first step lives in the proxy: hand it to the node's optimizer
            for g in w.optim.param_groups:
                for p in g["params"]:
                    if p in proxy.state:
                        w.optim.state[p] = proxy.state[p]
            w.optim._opt_called = True  # what the LR scheduler's wrapper of step() notes
        self.stacked_steps += 1

    def _gather_state(self, name: str, members: list[int], states: list[dict[str, Any]]) -> dict[str, Any]:
        """The members' state for parameter `name`, stacked: per-entry tensors as [M, ...] (views of the
        state stack where each member's is its slot's view), the step count as one scalar (equal in all)."""
        out: dict[str, Any] = {}
        for key, value in states[0].items():
            if key == "step" or not isinstance(value, torch.Tensor):
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            stack = self.state.get((name, key))
            views = stack is not None and all(s[key].data_ptr() == stack[r].data_ptr() for s, r in zip(states, members))
            if views and members == list(range(members[0], members[0] + len(members))):
                out[key] = stack[members[0]:members[0] + len(members)]
            else:
                out[key] = torch.stack([s[key] for s in states])
        return out

    def _scatter_state(self, name: str, members: list[int], stacked: dict[str, Any], optims: list[Any],
                       own: list[torch.Tensor]) -> None:
        """After the step: per-entry state into the [K, ...] stack (unless the step wrote it there), each
        member's entries views of its slot; the step count (and any other scalar) each member's own copy."""
        states = [opt.state[p] for opt, p in zip(optims, own)]
        for key, value in stacked.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                for state in states:
                    if isinstance(value, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                        state[key].copy_(value)
                    else:
                        state[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            stack = self.state.get((name, key))
            if stack is None:
                stack = self.state[(name, key)] = torch.zeros((self.stacks.num_nodes, *value.shape[1:]),
                                                              dtype=value.dtype, device=value.device)
            if value.data_ptr() != stack[members[0]].data_ptr():
                stack.index_copy_(0, torch.tensor(members, device=stack.device), value)
            for state, r in zip(states, members):
                state[key] = stack[r]


def _step_counts(steps: list[torch.Tensor | None]) -> tuple:
    """The parameters' step counts as numbers, read in one transfer (the fused kernels keep them on the GPU)."""
    held = [s for s in steps if s is not None]
    if not held:
        return tuple(steps)
    values = iter(torch.stack([s.reshape(()).float() for s in held]).tolist() if held[0].is_cuda else map(float, held))
    return tuple(None if s is None else next(values) for s in steps)


def prefer_fused_kernel(optim: torch.optim.Optimizer) -> None:
    """Step with torch's fused kernel (one pass over parameter, gradient and state) where the optimizer left the
    implementation to torch (foreach and fused both None). torch's for-loop default makes about ten passes, one
    per elementwise op: a stacked AdamW step of 32 MLP nodes took 25 ms that way and 5 ms fused (one thread,
    measured here). The node's own optimizer is switched, so a node stepping alone takes the same kernel and the
    stacking still moves no bit; the fused kernel rounds differently from the for-loop (an ulp), which is why an
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


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[M, ...] of equally shaped tensors: a view when they lie in one storage at equal, non-overlapping
    spacing with equal strides (the fused backward's gradients, in whatever layout autograd gave them; the
    state stacks' slots), else a copy."""
    t0 = tensors[0]
    if len(tensors) > 1:
        size = t0.element_size()
        gap, rest = divmod(tensors[1].data_ptr() - t0.data_ptr(), size)
        extent = 1 + sum((n - 1) * st for n, st in zip(t0.shape, t0.stride()))  # elements one tensor spans
        if rest == 0 and gap >= extent and all(
                t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() and t.shape == t0.shape
                and t.stride() == t0.stride() and t.data_ptr() == t0.data_ptr() + i * gap * size
                for i, t in enumerate(tensors)):
            return t0.as_strided((len(tensors), *t0.shape), (gap, *t0.stride()), t0.storage_offset())
    return torch.stack(tensors)


def _frozen(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.item()) if value.numel() == 1 else ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value
