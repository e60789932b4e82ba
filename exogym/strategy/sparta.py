"""SPARTA: sparse parameter averaging after every step (Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema,
Vrabie, "Improving the Efficiency of Distributed Training using Sparse Parameter Averaging", 2025,
openreview.net/forum?id=stFPf3gzq1)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch

from exogym._validation import check_int, check_number
from exogym.flatten import flatten_by_dtype, unflatten_into
from exogym.strategy.communicate import all_reduce
from exogym.strategy.communicate_optimize_strategy import CommunicationModule, ModularStrategy, round_generator
from exogym.strategy.optim import OptimSpec

__all__ = ["SparseCommunicator", "SPARTAStrategy", "SPARSIFICATION_MODES"]

SPARSIFICATION_MODES = ("random", "sequential", "partitioned")
_RANDOM, _PARTITIONED = 4, 5  # salts of the shared random streams


class SparseCommunicator(CommunicationModule):
    """After every step, a fraction p_sparta of each parameter's entries is averaged over all nodes
    (one all-reduce of just those values). Nodes pick the same entries from a shared seed, so no
    indices are sent.

    sparsification_mode: "random" (a fresh random subset each step, floor(p n) entries plus one more
    with probability frac(p n), so p n on average), "sequential" (a window of round(p n) entries moving
    through the parameter), "partitioned" (a random partition into round(1/p) parts, visited one part
    per step, so every entry is averaged once per round(1/p) steps; a new partition each cycle).
    async_delay=d: the averaged values arrive d steps late; each selected entry is then corrected by
    (average - its value when sent), keeping the local progress made meanwhile.
    """

    def __init__(self, p_sparta: float = 0.005, *, sparsification_mode: str = "random", async_delay: int = 0,
                 seed: int = 0):
        check_number("p_sparta", p_sparta, positive=True, maximum=1.0)
        if sparsification_mode not in SPARSIFICATION_MODES:
            raise ValueError(f"sparsification_mode must be one of {list(SPARSIFICATION_MODES)}, "
                             f"got {sparsification_mode!r}")
        check_int("async_delay", async_delay, minimum=0)
        check_int("seed", seed, minimum=0)
        self.p_sparta, self.mode, self.async_delay, self.seed = p_sparta, sparsification_mode, async_delay, seed
        self.pending: deque = deque()  # (step to apply at, [(parameter index, indices, correction)])

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.num_nodes = model, num_nodes

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        self._apply_due(local_step)
        if num_nodes == 1:
            return  # the average of one node is itself
        params = list(self.model.parameters())
        chosen = self.select(local_step, [p.numel() for p in params])
        sent = self._gather(params, chosen)
        averaged = [v.clone() for v in sent]
        self._reduce(averaged)
        self._write_back(local_step, params, chosen, sent, averaged)

    # ---- which entries (the same on every node) -------------------------------------------------
    def select(self, local_step: int, sizes: list[int]) -> list[torch.Tensor]:
        """Per parameter, the flat indices averaged after step `local_step` (CPU int64 tensors)."""
        p, t = self.p_sparta, local_step - 1
        if self.mode == "random":
            gen = round_generator(self.seed, t, _RANDOM)
            out = []
            for n in sizes:
                whole, frac = divmod(p * n, 1.0)
                k = min(n, int(whole) + int(torch.rand((), generator=gen).item() < frac))
                out.append(torch.randperm(n, generator=gen)[:k])
            return out
        if self.mode == "sequential":
            out = []
            for n in sizes:
                k = min(n, max(1, round(p * n)))
                out.append((t * k + torch.arange(k)) % n)
            return out
        parts = max(1, round(1 / p))
        cycle, part = divmod(t, parts)
        gen = round_generator(self.seed, cycle, _PARTITIONED)
        return [torch.randperm(n, generator=gen)[part::parts] for n in sizes]

    # ---- the steps of one synchronisation -------------------------------------------------------
    @torch.no_grad()
    def _gather(self, params: list[torch.Tensor], chosen: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.detach().view(-1)[idx.to(p.device)] for p, idx in zip(params, chosen)]  # [k_i] each

    @torch.no_grad()
    def _reduce(self, values: list[torch.Tensor]) -> None:
        """Average the selected values over the nodes: one all-reduce per dtype."""
        for flat, tensors in flatten_by_dtype(v for v in values if v.numel()):
            all_reduce(flat)
            flat.div_(self.num_nodes)
            unflatten_into(flat, tensors)

    @torch.no_grad()
    def _write_back(self, local_step: int, params: list[torch.Tensor], chosen: list[torch.Tensor],
                    sent: list[torch.Tensor], averaged: list[torch.Tensor]) -> None:
        if self.async_delay == 0:
            for p, idx, avg in zip(params, chosen, averaged):
                p.view(-1)[idx.to(p.device)] = avg
            return
        corrections = [(i, idx, avg - old) for i, (idx, old, avg) in enumerate(zip(chosen, sent, averaged))]
        self.pending.append((local_step + self.async_delay, corrections))

    @torch.no_grad()
    def _apply_due(self, local_step: int) -> None:
        """Apply the averages sent async_delay steps ago, as corrections on top of the local progress since."""
        params = None
        while self.pending and self.pending[0][0] <= local_step:
            params = params or list(self.model.parameters())
            for i, idx, correction in self.pending.popleft()[1]:
                params[i].view(-1).index_add_(0, idx.to(params[i].device), correction)

    def expected_fraction(self, sizes: list[int]) -> float:
        """The fraction of the model's entries sent per step, on average (for bytes-per-step estimates)."""
        if self.mode == "random":
            return self.p_sparta
        if self.mode == "sequential":
            return sum(min(n, max(1, round(self.p_sparta * n))) for n in sizes) / sum(sizes)
        return sum(math.ceil(n / max(1, round(1 / self.p_sparta))) for n in sizes) / sum(sizes)


class SPARTAStrategy(ModularStrategy):
    """SPARTA: every node takes its own optimizer step, then a fraction p_sparta of every parameter's
    entries (chosen by a shared seed) is averaged across all nodes; the rest stays local. The global
    model is the nodes' average.

    Paper: Beton et al., "Improving the Efficiency of Distributed Training using Sparse Parameter Averaging" (2025).
    Bytes per node per step: 2 (K-1)/K x p_sparta x the model's bytes (values only, no indices).
    A node that drops keeps its local progress; only the entries it would have averaged go unshared.

    optim_spec / inner_optim with lr and weight_decay: the inner optimizer (AdamW, lr 1e-3 by default).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 p_sparta: float = 0.005, sparsification_mode: str = "random", async_delay: int = 0, seed: int = 0,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules([SparseCommunicator(p_sparta, sparsification_mode=sparsification_mode,
                                              async_delay=async_delay, seed=seed)])
