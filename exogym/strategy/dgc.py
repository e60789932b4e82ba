"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018, arXiv 1712.01887)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.collectives import alive_ranks
from exogym.strategy.demo import _gather_flat
from exogym.strategy.optim import OptimSpec, ensure_optim_spec
from exogym.strategy.base import Strategy, parameter_state

__all__ = ["DGCStrategy"]

WARMUP_START = 0.25  # the paper's first warm-up stage sends 25% of the entries (75% sparsity)


class DGCStrategy(Strategy):
    """DGC: each node sends only the largest entries of its accumulated momentum, with indices.

    Each node clips its gradient, adds it to a momentum u <- m u + g and an accumulator v <- v + u, sends only
    the largest-|v| entries of each parameter (index, value) by one all-gather, zeroes u and v where it sent
    (momentum factor masking), and every node applies the same average of the sparse updates.

    Paper: Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the Communication Bandwidth for
    Distributed Training", ICLR 2018 (arXiv 1712.01887): momentum correction, local gradient clipping, momentum
    factor masking and warm-up training; sparsity warm-up as the paper's 75%, 93.75%, ... made continuous.
    Bytes per node per step (ring all-gather, K nodes up): (K-1) x sum over parameters of k_p x (4 + value
    bytes), k_p = max(1, ceil(f x numel_p)) entries, f the fraction sent at that step; int32 indices in one
    all-gather, the values in one per dtype. A node that drops keeps its own u and v; when it comes back it
    loads a survivor's state and starts with u = v = 0 (`joined()`); the others average over the nodes up.

    Args:
        optim_spec: An SGD spec (default `OptimSpec(SGD, lr=0.01)`); its lr and weight_decay act on the
            averaged sparse update, as SGD's step with that update as the gradient.
        target_sparsity: The fraction f of each parameter's entries SENT per step, as in the original EXO Gym
            (`--dgc_sparsity 0.001` = 0.1% of the entries are sent; the paper's "99.9% sparsity"). 0 < f <= 1;
            f = 1 sends everything.
        warmup_steps: The fraction sent decays exponentially from 25% (or `target_sparsity` if larger) to
            `target_sparsity` over the first `warmup_steps` steps: f_t = 0.25 (target / 0.25)^(t / warmup_steps).
            0: no warm-up. (This is the sparsity warm-up; the learning-rate warm-up goes in
            `lr_scheduler_kwargs`.)
        clip_threshold: Each node clips the norm of its own gradient (all its parameters) to this value before
            the momentum, or None. It is a per-node threshold, used as given: the paper's thr_G x N^(-1/2) for a
            global threshold thr_G on N nodes is `clip_threshold=thr_G / sqrt(N)`.
        momentum: m of the momentum correction. The inner optimizer must not add momentum again: it is built
            with momentum=0 (and no Nesterov); an `OptimSpec(SGD, momentum=x)` is accepted when x equals
            `momentum` (as the original's script passes) or is 0, anything else is an error.
        max_norm: Clips the averaged sparse update (the same on every node) before the optimizer step.
        lr: The optimizer's learning rate.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `cosine_anneal`,
            `min_lr_factor`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: An unknown keyword.
        ValueError: A value out of range, or an optimizer spec whose momentum is neither 0 nor `momentum`.
    """

    global_keys = frozenset({"optim"})  # the same update and SGD steps on every node

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, target_sparsity: float = 0.001,
                 warmup_steps: int = 0, clip_threshold: float | None = None, momentum: float = 0.9,
                 max_norm: float | None = None, *, lr: float | None = None, **kwargs: Any):
        # warmup_steps here is the sparsity warm-up; the base class's lr warm-up is in lr_scheduler_kwargs.
        super().__init__(max_norm=max_norm, **kwargs)
        check_number("target_sparsity", target_sparsity, positive=True, maximum=1.0)
        check_int("warmup_steps", warmup_steps, minimum=0)
        check_number("clip_threshold", clip_threshold, positive=True, allow_none=True)
        check_number("momentum", momentum, minimum=0.0)
        if momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        check_number("lr", lr, positive=True, allow_none=True, finite=True)
        self.target_sparsity, self.warmup_steps = float(target_sparsity), warmup_steps
        self.clip_threshold, self.momentum = clip_threshold, float(momentum)
        spec = ensure_optim_spec(optim_spec, OptimSpec(torch.optim.SGD, lr=0.01), lr=lr)
        if not issubclass(spec.cls, torch.optim.SGD):
            raise TypeError(f"DGCStrategy applies its sparse update with SGD (the paper's optimizer); got {spec!r}. "
                            "Pass OptimSpec(torch.optim.SGD, lr=...) or leave optim_spec out")
        inner = dict(spec.kwargs)
        given = inner.pop("momentum", 0.0)
        if given not in (0, 0.0) and given != momentum:
            raise ValueError(f"DGCStrategy's momentum correction uses momentum={momentum!r}, but optim_spec={spec!r} "
                             f"asks SGD for momentum={given!r}; the inner SGD runs without momentum (u holds it), "
                             "so pass the same value to both, or momentum=0 in the spec")
        if inner.pop("nesterov", False):
            raise ValueError(f"DGCStrategy's momentum correction is plain (heavy-ball) momentum; optim_spec={spec!r} "
                             "asks for Nesterov, which it does not implement")
        if inner.pop("dampening", 0) != 0:
            raise ValueError(f"DGCStrategy's momentum correction has no dampening (u <- m u + g); got {spec!r}")
        self.user_optim_spec = spec
        self.optim_spec = OptimSpec(spec.cls, **inner, momentum=0.0)  # what each node builds

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self.params = [p for p in model.parameters() if p.requires_grad]
        dense = torch.contiguous_format  # flat views of u and v below
        self.u = [torch.zeros_like(p, memory_format=dense) for p in self.params]  # momentum (per node)
        self.v = [torch.zeros_like(p, memory_format=dense) for p in self.params]  # accumulated, unsent (per node)

    # ---- the algorithm ----------------------------------------------------------------------------
    def fraction_sent(self, step: int) -> float:
        """The fraction of each parameter's entries sent at step `step` (0 for the first step).

        Args:
            step: The step, counted from 0.

        Returns:
            The fraction f of the warm-up schedule.
        """
        target = self.target_sparsity
        if step >= self.warmup_steps or target >= WARMUP_START:
            return target
        return WARMUP_START * (target / WARMUP_START) ** (step / self.warmup_steps)

    @staticmethod
    def entries_sent(numel: int, fraction: float) -> int:
        """k for a parameter of `numel` entries: ceil(fraction x numel), at least 1, at most numel.

        Args:
            numel: The parameter's number of entries.
            fraction: The fraction sent.

        Returns:
            k, the entries sent.
        """
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(round(fraction * numel, 9))))

    @torch.no_grad()
    def step(self) -> None:
        params = self.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.clip_threshold is not None:  # local gradient clipping, on this node's own gradient
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) \
                if grads else torch.tensor(0.0)
            scale = torch.clamp(self.clip_threshold / (norm + 1e-6), max=1.0)
            grads = [g * scale.to(g.device, g.dtype) for g in grads]
        fraction = self.fraction_sent(self.local_step)
        indices, values = [], []
        for u, v, g in zip(self.u, self.v, grads):
            u.mul_(self.momentum).add_(g)  # momentum correction
            v.add_(u)                      # local accumulation
            flat_v = v.view(-1)
            k = self.entries_sent(flat_v.numel(), fraction)
            idx = flat_v.abs().topk(k, sorted=False).indices
            values.append(flat_v[idx].clone().view(1, k))
            indices.append(idx.to(torch.int32).view(1, k))
            flat_v[idx] = 0                # momentum factor masking: what was sent leaves v and u
            u.view(-1)[idx] = 0
        members = alive_ranks() if self.num_nodes > 1 else [self.rank]
        sending = [i for i, t in enumerate(indices) if t.numel() > 0]
        if len(members) > 1 and sending:
            gathered_idx = _gather_flat([indices[i] for i in sending], len(members))
            gathered_val = _gather_flat([values[i] for i in sending], len(members))
        else:
            gathered_idx, gathered_val = [indices[i] for i in sending], [values[i] for i in sending]
        updates = [torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p in params]
        for i, idx, val in zip(sending, gathered_idx, gathered_val):
            k = indices[i].shape[1]
            total = updates[i].view(-1)
            for j in range(len(members)):  # rank order: the same sum, bit for bit, on every node
                total.index_add_(0, idx[0, j * k:(j + 1) * k].long(), val[0, j * k:(j + 1) * k])
            total.div_(len(members))
        for p, update in zip(params, updates):
            p.grad = update
        self.update_parameters()  # max_norm on the averaged update, then SGD (no momentum)
        super().step()

    # ---- the state protocol -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        state["local"]["dgc_u"] = [t.clone() for t in self.u]
        state["local"]["dgc_v"] = [t.clone() for t in self.v]
        return state

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        for mine, saved in zip(self.u + self.v, list(state["local"]["dgc_u"]) + list(state["local"]["dgc_v"])):
            mine.copy_(saved)

    @torch.no_grad()
    def joined(self) -> None:
        for t in self.u + self.v:  # the survivor's u and v are its own unsent gradients, which it still sends
            t.zero_()

    def global_state(self) -> Mapping[str, torch.Tensor]:
        return parameter_state(self.model)  # every node applies the same averaged update
