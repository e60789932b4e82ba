"""The outer model of DiLoCo-style strategies: the global parameters, the outer optimizer, and a round's steps.

DiLoCo, Streaming DiLoCo and SPARTA-DiLoCo keep a global model theta_g that every node holds identically
(each applies the same outer step to the same averaged pseudo-gradient, so nothing is broadcast). Its
pieces, each testable alone: pseudo_gradient (Delta_i = theta_g - theta_i), step (the outer optimizer on
the averaged Delta), merge (theta_i <- lerp(theta_g, theta_i, alpha); alpha=0 is DiLoCo's reset). Every
method takes parameter indices, so Streaming DiLoCo works on one fragment at a time.

Kept once: a module makes its outer model with `outer_model_for(...)`, which in the sim backend gives every
node of the run the same object (NodeContext.keep_once). The outer step of a sync is then
applied once, by the first node to get there (the rest find it done: every node would compute the same
bits, from the same mean); each node's own parameters still merge from it. On torch.distributed each process
holds its own, as a real node would.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from exogym.comm.flatten import flat_views
from exogym.strategy.base import trainable_parameters
from exogym.strategy.context import keep_once
from exogym.strategy.optim import OptimSpec

__all__ = ["OuterModel", "outer_model_for", "kept_nodes"]


class OuterModel:
    """theta_g (master parameters, kept on the CPU: touched once per round) and its outer optimizer, over the
    model's trainable parameters (`trainable_parameters`: frozen ones are never sent; the lists of parameters its
    methods take are in that order).

    normalize=True rescales the averaged pseudo-gradient to unit L2 norm (over the whole model) before the
    outer step ("sgd_normalized").
    """

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, *, normalize: bool = False):
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.master = [torch.nn.Parameter(p.detach().to("cpu", copy=True)) for p in trainable_parameters(model)]
        self.optim = spec.build(self.master)
        self.normalize = normalize
        self.applied_through = -1  # the last sync whose outer step is in theta_g (syncs count up from 0)

    def _indices(self, indices: Sequence[int] | None) -> Sequence[int]:
        return range(len(self.master)) if indices is None else indices

    @torch.no_grad()
    def pseudo_gradient(self, params: list[torch.Tensor], indices: Sequence[int] | None = None, *,
                        keep: bool = True) -> list[torch.Tensor]:
        """Delta_i = theta_g - theta_i (the outer gradient, DiLoCo's Algorithm 1) on `indices` (default all);
        zeros when this node's is lost (drop_prob) but it still takes part in the reduction."""
        chosen = list(self._indices(indices))
        out = flat_views([params[i] for i in chosen])  # one buffer: the mean sends it without a flattened copy
        for i, delta in zip(chosen, out):
            if keep:
                torch.sub(self.master[i].to(params[i].device), params[i].detach(), out=delta)
            else:
                delta.zero_()
        return out

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], indices: Sequence[int] | None = None, *, sync: int) -> None:
        """theta_g <- OuterOpt(theta_g, mean Delta) on `indices` for sync number `sync`, identical on every node
        (kept once: applied by the first node to call it). Parameters without a gradient (the other
        fragments) are left alone by the optimizer."""
        if sync <= self.applied_through:
            return  # another node of this process has applied this sync's step to the one shared copy
        self.applied_through = sync
        chosen = list(self._indices(indices))
        for i, grad in zip(chosen, grads):
            self.master[i].grad = grad.to(self.master[i].device, self.master[i].dtype)
        if self.normalize:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(self.master[i].grad)
                                                         for i in chosen]))
            for i in chosen:
                self.master[i].grad.div_(norm.clamp_min(1e-12))
        self.optim.step()
        self.optim.zero_grad()

    @torch.no_grad()
    def merge(self, params: list[torch.Tensor], indices: Sequence[int] | None = None, alpha: float = 0.0) -> None:
        """theta_i <- lerp(theta_g, theta_i, alpha) on `indices`: alpha=0 starts the node from the global model."""
        for i in self._indices(indices):
            g = self.master[i].to(params[i].device)
            params[i].copy_(g if alpha == 0 else torch.lerp(g, params[i], alpha))

    def global_state(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, (g.detach() for g in self.master)))

    def state_dict(self) -> dict[str, Any]:
        return {"master": [g.detach() for g in self.master], "optim": self.optim.state_dict(),
                "applied_through": self.applied_through}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for g, value in zip(self.master, state["master"]):
            g.copy_(value)
        self.optim.load_state_dict(state["optim"])
        self.applied_through = state["applied_through"]


def outer_model_for(owner: Any, key: str, model: torch.nn.Module, spec: OptimSpec, *,
                    normalize: bool = False) -> OuterModel:
    """The outer model of the module whose nodes share `key`: one for the run in the sim (every node holds the
    same theta_g by construction), one per process on torch.distributed. `owner`: the module bound to the node."""
    return keep_once(owner, ("outer_model", key), lambda: OuterModel(model, spec, normalize=normalize))


def kept_nodes(num_nodes: int, drop_prob: float, generator: torch.Generator | None) -> list[int]:
    """The nodes whose pseudo-gradient arrives in a round: all of them, or each kept with probability
    1 - drop_prob from a generator every node seeds alike (so they agree without sending anything)."""
    if drop_prob == 0:
        return list(range(num_nodes))
    u = torch.rand(num_nodes, generator=generator)
    return [r for r in range(num_nodes) if u[r] >= drop_prob]
