"""SPARTA: sparse parameter averaging after every step (Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema,
Vrabie, "Improving the Efficiency of Distributed Training using Sparse Parameter Averaging", 2025,
openreview.net/forum?id=stFPf3gzq1)."""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.compression import Quantizer, TopK, compressor_from
from exogym.comm.collectives import alive_ranks
from exogym.strategy.base import trainable_parameters
from exogym.strategy.context import keep_once
from exogym.strategy.communicate_optimize_strategy import (CommunicationModule, ModularStrategy, compressor_state,
                                                           round_generator)
from exogym.comm.mean import mean_, start_mean
from exogym.strategy.index_selectors import (SELECTOR_MODES, IndexSelector, PartitionedIndexSelector,
                                             RandomIndexSelector, ShuffledSequentialIndexSelector, flat_indices,
                                             num_parts, partition_part, shared_random, shuffled_permutation,
                                             shuffled_window)
from exogym.strategy.optim import OptimSpec

__all__ = ["SparseCommunicator", "TopKSparseCommunicator", "SPARTAStrategy", "SPARSIFICATION_MODES",
           "IndexSelector", "RandomIndexSelector", "ShuffledSequentialIndexSelector", "PartitionedIndexSelector"]

SPARSIFICATION_MODES = ("random", "sequential", "shuffled_sequential", "partitioned", "blockwise")
_RANDOM, _BLOCK = 4, 6  # salts of the shared random streams (index_selectors.py has the others)


class SparseCommunicator(CommunicationModule):
    """After every step, a fraction p_sparta of each parameter's entries is averaged over all nodes
    (one all-reduce of just those values). Nodes pick the same entries from a shared seed, so no
    indices are sent.

    sparsification_mode: "random" (a fresh random subset each step, floor(p n) entries plus one more
    with probability frac(p n), so p n on average), "sequential" (a window of round(p n) entries moving
    through the parameter in index order), "shuffled_sequential" (a fixed random permutation of the entries,
    drawn once from the shared seed, cut into P = ceil(1/p) windows of n/P entries walked one per step, as
    the original EXO Gym's ShuffledSequentialIndexSelector), "partitioned" (a random partition into
    P = min(ceil(1/p), n) parts, visited one part per step, so every entry is averaged once per P steps; a
    new partition each cycle; the original's PartitionedIndexSelector). Bytes follow the entries actually sent:
    with ceil(1/p) parts that is n/ceil(1/p) per step, at most p n (at p=0.4: a third, not p). "blockwise"
    (one contiguous block of round(p n) entries per parameter, at a shared random offset each step).
    "topk" (each node's largest changes, with indices) is TopKSparseCommunicator; SPARTAStrategy takes it
    as sparsification_mode="topk". interval=m: average only after every m-th step (the original's
    sparta_interval).
    async_delay=d: the averaged values arrive d steps late; each selected entry is then corrected by
    (average - its value when sent), keeping the local progress made meanwhile.
    quantization_bits=8 or 4 / compression=<a Quantizer of exogym.comm.compression>: the selected values are
    sent quantized (one scale per parameter, or per block), by one all-gather, and averaged decoded
    (exogym.strategy.compressed_reduce); bytes per node per step (K-1) x sum of quantizer.nbytes([k_i]).
    The averages then lie on the quantizer's grid (max |values| / 127 per parameter for int8): with p near
    1 prefer TopKSparseCommunicator, which sends quantized drifts instead of values.
    """

    def __init__(self, p_sparta: "float | IndexSelector" = 0.005, *, sparsification_mode: str = "random",
                 async_delay: int = 0, seed: int = 0, quantization_bits: int | None = None,
                 compression: Quantizer | None = None, interval: int = 1):
        self.selector: IndexSelector | None = None
        if isinstance(p_sparta, IndexSelector):  # the original's SparseCommunicator(index_selector)
            if sparsification_mode != "random":
                raise ValueError(f"SparseCommunicator got an index selector ({p_sparta!r}) and sparsification_mode="
                                 f"{sparsification_mode!r}; the selector picks the entries, drop sparsification_mode")
            mode = SELECTOR_MODES.get(type(p_sparta))
            if mode is not None:  # the built-in selectors are the modes of the same name, exactly
                p_sparta, sparsification_mode = p_sparta.p, mode
            else:
                self.selector = p_sparta
        if self.selector is None:
            check_number("p_sparta", p_sparta, positive=True, maximum=1.0)
        check_int("interval", interval, minimum=1)
        self.interval = interval
        if sparsification_mode == "topk":
            raise ValueError("sparsification_mode='topk' sends each node's largest changes with their indices: that "
                             "is TopKSparseCommunicator(p_sparta) (or SPARTAStrategy(sparsification_mode='topk'))")
        if sparsification_mode not in SPARSIFICATION_MODES:
            raise ValueError(f"sparsification_mode must be one of {list(SPARSIFICATION_MODES)}, "
                             f"got {sparsification_mode!r}")
        check_int("async_delay", async_delay, minimum=0)
        check_int("seed", seed, minimum=0)
        self.p_sparta, self.mode, self.async_delay, self.seed = p_sparta, sparsification_mode, async_delay, seed
        self.pending: deque = deque()  # (step to apply at, [(parameter index, indices, correction)])
        self.compression = compressor_from(quantization_bits, compression)
        if self.compression is not None and not isinstance(self.compression, Quantizer):
            raise TypeError(f"SparseCommunicator sends parameter values, which need a dense quantizer "
                            f"(IntQuantizer, FP8Quantizer, FP4Quantizer), got compression={compression!r}; "
                            f"for top-k use TopKSparseCommunicator")

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.num_nodes = model, num_nodes

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        self._apply_due(local_step)
        if local_step % self.interval or len(alive_ranks()) == 1:
            return  # not an averaging step, or the average of one node is itself
        params = trainable_parameters(self.model)
        if self.selector is not None:
            chosen = self._select_with(local_step // self.interval - 1, params)
        else:
            chosen = self.select(local_step // self.interval, [p.numel() for p in params])
        sent = self._gather(params, chosen)
        averaged = [v.clone() for v in sent]
        self._reduce(averaged)
        self._write_back(local_step, params, chosen, sent, averaged)

    # ---- which entries (the same on every node) -------------------------------------------------
    def select(self, local_step: int, sizes: list[int]) -> list[torch.Tensor]:
        """Per parameter, the flat indices averaged at the `local_step`-th averaging (CPU int64 tensors); with
        interval=1 that is after step `local_step`."""
        p, t = self.p_sparta, local_step - 1
        if self.mode == "blockwise":
            gen = round_generator(self.seed, t, _BLOCK)
            out = []
            for n in sizes:
                k = min(n, max(1, round(p * n)))
                start = int(torch.randint(n - k + 1, (), generator=gen))
                out.append(torch.arange(start, start + k))
            return out
        if self.mode == "random":
            gen = round_generator(self.seed, t, _RANDOM)
            out = []
            for n in sizes:
                whole, frac = divmod(p * n, 1.0)
                k = min(n, int(whole) + int(torch.rand((), generator=gen).item() < frac))
                out.append(torch.randperm(n, generator=gen)[:k].clone())  # not a view: n indices would live on
            return out
        if self.mode == "sequential":
            out = []
            for n in sizes:
                k = min(n, max(1, round(p * n)))
                out.append((t * k + torch.arange(k)) % n)
            return out
        if self.mode == "shuffled_sequential":
            return [self._window(t, i, n) for i, n in enumerate(sizes)]
        return [partition_part(self.seed, i, n, p, t) for i, n in enumerate(sizes)]

    def _window(self, t: int, index: int, n: int) -> torch.Tensor:
        """Window t mod P of parameter `index`'s fixed permutation (shuffled_window)."""
        # Drawn once per parameter and the same on every node: kept once for the run (outside one, drawn anew)
        perm = keep_once(self, ("sparta_permutation", self.seed, index, n),
                         lambda: shuffled_permutation(self.seed, index, n))
        return shuffled_window(perm, self.p_sparta, t)

    def _select_with(self, t: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter, the flat indices the selector picks at averaging t, every node with the same random
        streams (shared_random), so every node picks the same entries and no mask is sent."""
        out = []
        for i, p in enumerate(params):
            with shared_random(self.seed, t, i, p.device):
                picked = self.selector.get_indices(p.detach(), t)
            out.append(flat_indices(picked, p, self.selector))
        return out

    # ---- the steps of one synchronisation -------------------------------------------------------
    @torch.no_grad()
    def _gather(self, params: list[torch.Tensor], chosen: list[torch.Tensor]) -> list[torch.Tensor]:
        return [p.detach().view(-1)[idx.to(p.device)] for p, idx in zip(params, chosen)]  # [k_i] each

    @torch.no_grad()
    def _reduce(self, values: list[torch.Tensor]) -> None:
        """Average the selected values over the nodes: one all-reduce per dtype (or one all-gather, quantized)."""
        mean_([v for v in values if v.numel()], self.compression)

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
            params = params or trainable_parameters(self.model)
            for i, idx, correction in self.pending.popleft()[1]:
                params[i].view(-1).index_add_(0, idx.to(params[i].device), correction)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {"global": {}, "local": {"pending": [(due, corrections) for due, corrections in self.pending]}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.pending = deque((due, [tuple(c) for c in corrections]) for due, corrections in state["local"]["pending"])

    def joined(self) -> None:
        self.pending.clear()  # the survivor's corrections belong to averages the joiner did not send

    def expected_fraction(self, sizes: list[int]) -> float:
        """The fraction of the model's entries sent per step, on average (for bytes-per-step estimates); an index
        selector of your own: its p, else nan."""
        if self.selector is not None:
            return float(getattr(self.selector, "p", math.nan))
        if self.mode == "random":
            return self.p_sparta
        if self.mode in ("sequential", "blockwise"):
            return sum(min(n, max(1, round(self.p_sparta * n))) for n in sizes) / sum(sizes)
        if self.mode == "shuffled_sequential":  # every entry once per P steps
            return sum(n / num_parts(self.p_sparta, n) for n in sizes) / sum(sizes)
        return sum(n / min(num_parts(self.p_sparta, n), n) for n in sizes) / sum(sizes)


class TopKSparseCommunicator(CommunicationModule):
    """After every step each node sends, per parameter, its k = max(1, round(p_sparta n)) entries that have
    drifted furthest from the shared model theta_g (int32 indices + values, the values optionally
    quantized); every node adds the mean of all nodes' sent drifts to theta_g and keeps its own unsent
    drift on top: theta_i = theta_g + (what node i has not sent yet), error feedback by construction.
    With p_sparta=1 this is parameter averaging after every step.

    Bytes per node per step: (K-1) x sum over parameters of k_i (4 + 4) for float32 values, or
    k_i 4 + quantizer.nbytes([k_i]) with quantization_bits / compression (one all-gather).
    """

    def __init__(self, p_sparta: float = 0.005, *, quantization_bits: int | None = None,
                 compression: Quantizer | None = None, interval: int = 1):
        check_number("p_sparta", p_sparta, positive=True, maximum=1.0)
        check_int("interval", interval, minimum=1)
        self.interval = interval  # send after every interval-th step; the drift keeps growing in between
        values = compressor_from(quantization_bits, compression)
        if values is not None and not isinstance(values, Quantizer):
            raise TypeError(f"TopKSparseCommunicator picks the entries itself; compression= quantizes their values "
                            f"and must be IntQuantizer, FP8Quantizer or FP4Quantizer, got {compression!r}")
        self.p_sparta, self.compression = p_sparta, copy.deepcopy(values)

    @torch.no_grad()
    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.num_nodes = model, num_nodes
        self.shared = [p.detach().clone() for p in trainable_parameters(model)]  # theta_g, identical on every node
        self.selector = TopK(self.p_sparta, values=self.compression)

    @torch.no_grad()
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        if local_step % self.interval or len(alive_ranks()) == 1:
            return
        params = trainable_parameters(self.model)
        drift = [p.detach() - g for p, g in zip(params, self.shared)]  # what node i has not shared yet
        pending = start_mean(drift, self.selector)
        for p, g, d, sent, mean in zip(params, self.shared, drift, pending.sent(), pending.wait()):
            g.add_(mean)
            p.copy_(g + (d - sent))

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {"global": {"shared": list(self.shared)}, "local": {"compression": compressor_state(self.compression)}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        for g, value in zip(self.shared, state["global"]["shared"]):
            g.copy_(value)

    @torch.no_grad()
    def joined(self) -> None:
        for g, p in zip(self.shared, trainable_parameters(self.model)):
            p.copy_(g)  # the joiner has sent everything: nothing unsent yet


class SPARTAStrategy(ModularStrategy):
    """SPARTA: every node takes its own optimizer step, then a fraction p_sparta of every parameter's
    entries (chosen by a shared seed) is averaged across all nodes; the rest stays local. The global
    model is the nodes' average.

    Paper: Beton et al., "Improving the Efficiency of Distributed Training using Sparse Parameter Averaging" (2025).
    Bytes per node per step: 2 (K-1)/K x p_sparta x the model's bytes (values only, no indices).
    A node that drops keeps its local progress; only the entries it would have averaged go unshared.

    optim_spec / inner_optim with lr and weight_decay: the inner optimizer (AdamW, lr 1e-3 by default).
    quantization_bits=8 or 4 (or compression=<a Quantizer>): the values are sent quantized by one all-gather,
    (K-1) x the quantized values' bytes per node per step (one float32 scale per parameter).
    compression_method="topk" or sparsification_mode="topk" (the original documents' spellings): instead of
    shared-seed entries, each node sends its p_sparta largest drifts from the shared model (its change since it
    last sent them), with indices (TopKSparseCommunicator). sparta_interval=m: average after every m-th step.
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 p_sparta: float = 0.005, sparsification_mode: str = "random", async_delay: int = 0, seed: int = 0,
                 compression_method: str | None = None, quantization_bits: int | None = None,
                 compression: Quantizer | None = None, sparta_interval: int = 1,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        if compression_method not in (None, "topk"):
            raise ValueError(f"compression_method must be None (shared-seed entries, no indices sent) or 'topk' "
                             f"(each node's largest drifts, with indices), got {compression_method!r}")
        if compression_method == "topk" or sparsification_mode == "topk":
            if sparsification_mode not in ("random", "topk") or async_delay:
                raise ValueError(f"top-k picks the entries itself and applies them at once; drop "
                                 f"sparsification_mode={sparsification_mode!r} and async_delay={async_delay!r}")
            module: CommunicationModule = TopKSparseCommunicator(p_sparta, quantization_bits=quantization_bits,
                                                                 compression=compression, interval=sparta_interval)
        else:
            module = SparseCommunicator(p_sparta, sparsification_mode=sparsification_mode, async_delay=async_delay,
                                        seed=seed, quantization_bits=quantization_bits, compression=compression,
                                        interval=sparta_interval)
        self._use_modules([module])



