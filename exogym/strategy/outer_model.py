"""The outer model of DiLoCo-style strategies: the global parameters, the outer optimizer, and a round's steps.

DiLoCo, Streaming DiLoCo and SPARTA-DiLoCo keep a global model theta_g that every node holds identically
(each applies the same outer step to the same averaged pseudo-gradient, so nothing is broadcast). Its
pieces, each testable alone: pseudo_gradient (Delta_i = theta_g - theta_i), step (the outer optimizer on
the averaged Delta), merge (theta_i <- lerp(theta_g, theta_i, alpha); alpha=0 is DiLoCo's reset). Every
method takes parameter indices, so Streaming DiLoCo works on one fragment at a time.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from exogym.strategy.optim import OptimSpec

__all__ = ["OuterModel", "kept_nodes"]


class OuterModel:
    """theta_g (master parameters, kept on the CPU: touched once per round) and its outer optimizer.

    normalize=True rescales the averaged pseudo-gradient to unit L2 norm (over the whole model) before the
    outer step ("sgd_normalized").
    """

    def __init__(self, model: torch.nn.Module, spec: OptimSpec, *, normalize: bool = False):
        self.names = [name for name, _ in model.named_parameters()]
        self.master = [torch.nn.Parameter(p.detach().to("cpu", copy=True)) for p in model.parameters()]
        self.optim = spec.build(self.master)
        self.normalize = normalize

    def _indices(self, indices: Sequence[int] | None) -> Sequence[int]:
        return range(len(self.master)) if indices is None else indices

    @torch.no_grad()
    def pseudo_gradient(self, params: list[torch.Tensor], indices: Sequence[int] | None = None, *,
                        keep: bool = True) -> list[torch.Tensor]:
        """Delta_i = theta_g - theta_i (the outer gradient, DiLoCo's Algorithm 1) on `indices` (default all);
        zeros when this node's is lost (drop_prob) but it still takes part in the reduction."""
        return [(self.master[i].to(params[i].device) - params[i].detach()) if keep else torch.zeros_like(params[i])
                for i in self._indices(indices)]

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], indices: Sequence[int] | None = None) -> None:
        """theta_g <- OuterOpt(theta_g, mean Delta) on `indices`, identical on every node. Parameters without
        a gradient (the other fragments) are left alone by the optimizer."""
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
        return {"master": [g.detach() for g in self.master], "optim": self.optim.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for g, value in zip(self.master, state["master"]):
            g.copy_(value)
        self.optim.load_state_dict(state["optim"])


def kept_nodes(num_nodes: int, drop_prob: float, generator: torch.Generator | None) -> list[int]:
    """The nodes whose pseudo-gradient arrives in a round: all of them, or each kept with probability
    1 - drop_prob from a generator every node seeds alike (so they agree without sending anything)."""
    if drop_prob == 0:
        return list(range(num_nodes))
    u = torch.rand(num_nodes, generator=generator)
    return [r for r in range(num_nodes) if u[r] >= drop_prob]
