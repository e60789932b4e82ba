"""Streaming DiLoCo: DiLoCo that synchronises one fragment of the model at a time, overlapped with compute
(Douillard, Donchev, Rush, Kale, et al., "Streaming DiLoCo with overlapping communication: Towards a
Distributed Free Lunch", 2025, arXiv 2501.18512)."""

from __future__ import annotations

import copy
import uuid
from collections import deque
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.compression import Compressor, compressor_from
from exogym.strategy.communicate_optimize_strategy import (CommunicationModule, ModularStrategy, compressor_state,
                                                           round_generator)
from exogym.strategy.diloco import _one_of, outer_choice, outer_spec
from exogym.comm.mean import PendingMean, start_mean
from exogym.strategy.base import trainable_parameters
from exogym.strategy.optim import OptimSpec
from exogym.strategy.outer_model import OuterModel, kept_nodes, outer_model_for

__all__ = ["StreamingDiLoCoCommunicator", "StreamingDiLoCoStrategy", "FRAGMENT_PATTERNS", "OVERLAP_SCHEDULES"]

FRAGMENT_PATTERNS = ("strided", "sequential")
OVERLAP_SCHEDULES = ("paper", "torchft")
_DROP = 6  # salt of the random stream that decides dropped outer gradients


class StreamingDiLoCoCommunicator(CommunicationModule):
    """DiLoCo's round (pseudo-gradient, mean, outer step, merge) for one fragment of the model at a time.

    The model's layers (its parameters grouped by the module that holds them, in order) are split into
    `num_fragments` = F fragments. Fragment f's boundaries are steps (f + 1) H/F, (f + 1) H/F + H, ...: one
    fragment every H/F steps, each once every H steps. Either overlap schedule lets the transfer overlap tau
    steps of compute (an async collective); then the outer optimizer moves the fragment of the global model and
    each node merges: `theta_i <- lerp(theta_global, theta_i, alpha)` (alpha=0: DiLoCo's reset). At the run's
    last step every fragment still in flight is waited for and applied.

    Bytes per node per fragment sync: 2 (K-1)/K x the fragment's bytes (ring all-reduce), or (K-1) x sum over
    its parameters of `compressor.nbytes(shape)` with `quantization_bits` / `compression` (one all-gather); over
    H steps the whole model once, as DiLoCo, but the largest single sync is ~1/F of it.
    Failures and elastic pools are not supported: a node coming up would miss the fragments in flight, and
    its global model would then differ from the others'.

    Args:
        H: Steps between two syncs of the same fragment.
        outer_optim_spec: The outer optimizer (default: SGD, lr 0.7, Nesterov momentum 0.9).
        num_fragments: F; H must be divisible by F.
        fragment_pattern: `"sequential"` (consecutive layers) or `"strided"` (layer l in fragment l mod F).
        tau: Steps of compute the transfer overlaps, `0 <= tau < H/F`.
        alpha: The merge's mix, in [0, 1].
        drop_prob: Each sync each node's pseudo-gradient is lost with probability p (shared seed); the others'
            are averaged, every node takes the outer step, and a dropped node keeps its own parameters.
        seed: The seed of the shared random stream that decides dropped pseudo-gradients.
        quantization_bits: 8 or 4: send the pseudo-gradients quantized.
        compression: A Compressor of `exogym.comm.compression` for the pseudo-gradients.
        final_sync: Every other fragment is synchronised once more at the end, so the global model includes
            every step.
        overlap: `"paper"` (the Streaming DiLoCo paper's schedule: the fragment's pseudo-gradient is sent at
            its boundary and its average applied tau steps later) or `"torchft"` (torchft's DiLoCo,
            `fragment_sync_delay=tau`: sent tau steps before the boundary and applied at it).

    Raises:
        ValueError: A value out of range or an unknown pattern or overlap.
    """

    supports_membership_changes = False

    def __init__(self, H: int = 100, outer_optim_spec: OptimSpec | None = None, *, num_fragments: int = 4,
                 fragment_pattern: str = "strided", tau: int = 1, alpha: float = 0.5, drop_prob: float = 0.0,
                 seed: int = 0, quantization_bits: int | None = None, compression: Compressor | None = None,
                 final_sync: bool = True, overlap: str = "paper"):
        check_int("H", H, minimum=1)
        check_int("num_fragments", num_fragments, minimum=1)
        if H % num_fragments:
            divisors = [d for d in range(1, H + 1) if H % d == 0]
            raise ValueError(f"H must be divisible by num_fragments (one fragment is sent every H/num_fragments "
                             f"steps): H={H}, num_fragments={num_fragments}; use num_fragments in {divisors}")
        if fragment_pattern not in FRAGMENT_PATTERNS:
            raise ValueError(f"fragment_pattern must be one of {list(FRAGMENT_PATTERNS)}, got {fragment_pattern!r}")
        if overlap not in OVERLAP_SCHEDULES:
            raise ValueError(f"overlap must be one of {list(OVERLAP_SCHEDULES)} ('paper': send at the fragment's "
                             f"boundary, apply tau steps later; 'torchft': send tau steps before it, apply at it), "
                             f"got {overlap!r}")
        check_int("tau", tau, minimum=0)
        if tau >= H // num_fragments:
            every = H // num_fragments
            raise ValueError(f"tau must be < H/num_fragments = {H}/{num_fragments} = {every}, got tau={tau}: a "
                             f"fragment's mean must arrive before the next one is sent; use tau in 0..{every - 1}")
        check_number("alpha", alpha, minimum=0.0, maximum=1.0)
        check_number("drop_prob", drop_prob, minimum=0.0)
        if drop_prob >= 1:
            raise ValueError(f"drop_prob must be < 1 (every pseudo-gradient would be lost), got {drop_prob!r}")
        check_int("seed", seed, minimum=0)
        if not isinstance(final_sync, bool):
            raise TypeError(f"final_sync must be True or False, got {final_sync!r}")
        self.final_sync = final_sync
        self._outer_key = uuid.uuid4().hex  # every node's copy of this module shares it: one outer model
        self.H, self.num_fragments, self.fragment_pattern = H, num_fragments, fragment_pattern
        self.tau, self.alpha, self.drop_prob, self.seed = tau, float(alpha), drop_prob, seed
        self.overlap = overlap
        self.outer_optim_spec = outer_spec(outer_optim_spec)
        self.compression = copy.deepcopy(compressor_from(quantization_bits, compression))  # its own memory

    @torch.no_grad()
    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        # It steps only the fragment whose grads are set. Kept once for the run when every sync blocks (tau=0);
        # with overlap a node may still read theta_g of a fragment another node has already moved, so each
        # node keeps its own.
        self.outer = (outer_model_for(self, self._outer_key, model, self.outer_optim_spec) if self.tau == 0
                      else OuterModel(model, self.outer_optim_spec))
        self.fragments = self.split(self.outer.names)
        # (due step, fragment, kept nodes, mean, sync index)
        self.in_flight: deque[tuple[int, int, list[int], PendingMean | _Arrived, int]] = deque()

    @property
    def master(self) -> list[torch.nn.Parameter]:
        """The global model's parameters (the outer model's)."""
        return self.outer.master

    # ---- which parameters, when (the same answer on every node) ---------------------------------
    def split(self, names: list[str]) -> list[list[int]]:
        """Per fragment, the indices of its parameters: layers are the parameters' owning modules, in order.

        Args:
            names: The model's trainable parameter names, in order.

        Returns:
            One list of parameter indices per fragment.
        """
        layers: dict[str, list[int]] = {}
        for i, name in enumerate(names):
            layers.setdefault(name.rpartition(".")[0], []).append(i)
        groups, f = list(layers.values()), self.num_fragments
        if f > len(groups):
            raise ValueError(f"num_fragments={f} is more than the model's {len(groups)} layers (parameters grouped "
                             f"by module: {list(layers)}); use num_fragments <= {len(groups)}")
        owner = [l % f if self.fragment_pattern == "strided" else l * f // len(groups) for l in range(len(groups))]
        return [[i for l, group in enumerate(groups) if owner[l] == frag for i in group] for frag in range(f)]

    def _boundary(self, local_step: int) -> int:
        """The fragment boundary that a send after `local_step` belongs to (torchft sends tau steps early)."""
        return local_step + (self.tau if self.overlap == "torchft" else 0)

    def fragment_sent_after(self, local_step: int) -> int | None:
        """The fragment sent after step `local_step`, if any.

        Fragment f is sent after step (f + 1) H/F + n H (the paper's schedule), or tau steps before that
        (torchft's).

        Args:
            local_step: The inner steps done.

        Returns:
            The fragment's index, or None.
        """
        every, boundary = self.H // self.num_fragments, self._boundary(local_step)
        if boundary % every:
            return None
        return (boundary // every - 1) % self.num_fragments

    def kept_nodes(self, sync_index: int) -> list[int]:
        """The nodes whose pseudo-gradient arrives in sync `sync_index` (counted over all fragments, from 0).

        Args:
            sync_index: The sync, counted over all fragments from 0.

        Returns:
            The ranks kept, sorted.
        """
        return kept_nodes(self.num_nodes, self.drop_prob, round_generator(self.seed, sync_index, _DROP)
                          if self.drop_prob else None)

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        fragment = self.fragment_sent_after(local_step)
        if fragment is not None:
            self._send(fragment, local_step)
        self._apply_due(local_step)

    def finish(self, local_step: int) -> None:
        """Synchronise once more every fragment with steps since its last sync, at once.

        The one sent at the last step has just been applied, so the global model includes every step.

        Args:
            local_step: The inner steps done.
        """
        if not self.final_sync:
            return
        just_sent = self.fragment_sent_after(local_step)
        next_sync = self._boundary(local_step) // (self.H // self.num_fragments)  # past every index used
        for fragment in range(self.num_fragments):
            if fragment != just_sent:
                self._start_sync(fragment, local_step, sync_index=next_sync, due=local_step)
                next_sync += 1
        self._apply_due(local_step)

    # ---- the steps of one fragment's sync -------------------------------------------------------
    def _send(self, fragment: int, local_step: int) -> None:
        """The schedule's sync of `fragment` after `local_step`: applied tau steps later."""
        self._start_sync(fragment, local_step, sync_index=self._boundary(local_step) // (self.H // self.num_fragments) - 1,
                         due=local_step + self.tau)

    def _start_sync(self, fragment: int, local_step: int, *, sync_index: int, due: int) -> None:
        """Start the mean of the fragment's pseudo-gradients; it is applied after step `due`."""
        kept = self.kept_nodes(sync_index)
        if not kept:
            return  # every pseudo-gradient of this sync was lost: nothing to apply, nothing to send
        grads = self.outer.pseudo_gradient(trainable_parameters(self.model), self.fragments[fragment],
                                           keep=self.rank in kept)
        if self.num_nodes == 1:
            self.in_flight.append((due, fragment, kept, _Arrived(grads), sync_index))
            return
        keys = [("outer", i) if self.rank in kept else None for i in self.fragments[fragment]]
        mean = start_mean(grads, self.compression, members=kept, keys=keys, async_op=due > local_step)
        self.in_flight.append((due, fragment, kept, mean, sync_index))

    def _apply_due(self, local_step: int) -> None:
        """Apply the means that have arrived (every one still in flight at the run's last step)."""
        last = local_step == self.context.max_steps
        while self.in_flight and (self.in_flight[0][0] <= local_step or last):
            _, fragment, kept, mean, sync = self.in_flight.popleft()
            self.outer.step(mean.wait(), self.fragments[fragment], sync=sync)
            if self.rank in kept:
                self.outer.merge(trainable_parameters(self.model), self.fragments[fragment], self.alpha)

    def global_state(self, local_step: int) -> Mapping[str, torch.Tensor]:
        return self.outer.global_state()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        # Means in flight are waited for (their handles are transfers, not state) and kept as arrived values,
        # applied when due: a checkpoint mid-flight resumes exactly.
        in_flight = [(due, fragment, kept, mean.wait(), sync) for due, fragment, kept, mean, sync in self.in_flight]
        return {"global": {"outer": self.outer.state_dict()},
                "local": {"in_flight": in_flight, "compression": compressor_state(self.compression)}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.outer.load_state_dict(state["global"]["outer"])
        self.in_flight = deque((due, fragment, list(kept), _Arrived(list(grads)), sync)
                               for due, fragment, kept, grads, sync in state["local"]["in_flight"])
        if self.compression is not None:
            self.compression.load_state_dict(state["local"]["compression"])


class _Arrived:
    """A mean that needs no transfer: one node's own pseudo-gradient, or one restored from a checkpoint."""

    def __init__(self, grads: list[torch.Tensor]):
        self.grads = grads

    def wait(self) -> list[torch.Tensor]:
        return self.grads


class StreamingDiLoCoStrategy(ModularStrategy):
    """Streaming DiLoCo: DiLoCo whose synchronisation is spread over the round, one fragment at a time.

    The model is split into F fragments; every H/F steps one fragment's pseudo-gradients are averaged
    (optionally quantized) while the nodes keep training, and tau steps later the outer optimizer moves that
    fragment of the global model and each node merges it: `theta_i <- lerp(theta_global, theta_i, alpha)`.
    With `num_fragments=1, tau=0, alpha=0` it is DiLoCo.

    Paper: Douillard et al., "Streaming DiLoCo with overlapping communication", 2025 (arXiv 2501.18512).
    Bytes per node per step: 2 (K-1)/K x M / H, as DiLoCo, but each sync moves only ~M / F (peak bandwidth
    / F); with `quantization_bits` / `compression`, (K-1) x the compressed model's bytes / H.
    A node whose pseudo-gradient is dropped (`drop_prob`) keeps its local progress on that fragment.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default AdamW, lr 1e-3).
        outer_optim_spec: The outer optimizer, as in DiLoCoStrategy (default Nesterov SGD, lr 0.7, momentum 0.9).
        H: Steps between two syncs of the same fragment.
        num_fragments: F, the number of fragments; H must be divisible by F.
        fragment_pattern: `"strided"` (layer l in fragment l mod F) or `"sequential"` (consecutive layers).
        tau: Steps of compute a fragment's transfer overlaps, `0 <= tau < H/F`.
        alpha: The merge's mix, in [0, 1] (0: DiLoCo's reset to the global model).
        quantization_bits: 8 or 4: send the pseudo-gradients quantized (see `compression`).
        compression: A Compressor of `exogym.comm.compression` for the pseudo-gradients (one all-gather).
        inner_optim: The same as `optim_spec` (pass one of them).
        outer_optim: The same as `outer_optim_spec` (pass one of them).
        lr: The inner optimizer's learning rate.
        inner_lr: The same as `lr` (pass one of them).
        weight_decay: The inner optimizer's weight decay.
        outer_lr: The outer optimizer's learning rate.
        outer_momentum: The outer SGD's momentum.
        nesterov: Whether the outer SGD's momentum is Nesterov's.
        drop_prob: Each sync each node's pseudo-gradient is lost with this probability (shared seed).
        seed: The seed of the shared random stream that decides dropped pseudo-gradients.
        final_sync: At the end of the run, every fragment with steps since its last sync is synchronised once
            more (counted), so the returned model and the final validation include every step; False leaves
            them out.
        overlap: `"paper"` (send at the fragment's boundary, apply tau steps later) or `"torchft"` (send tau
            steps before the boundary, apply at it, as torchft's DiLoCo with `fragment_sync_delay=tau`).
        max_norm: Clip the global gradient norm to this before each inner step.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
                    `cosine_anneal`, `min_lr_factor`), and, after an optimizer name or class, that optimizer's own
                    options (`momentum=0.9`, `betas=...`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: Both spellings of an option are given, or an unknown keyword.
        ValueError: A value out of range (H not divisible by F, tau >= H/F, alpha outside [0, 1], ...).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None,
                 outer_optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, num_fragments: int = 4,
                 fragment_pattern: str = "strided", tau: int = 1, alpha: float = 0.5,
                 quantization_bits: int | None = None, compression: Compressor | None = None,
                 inner_optim: OptimSpec | str | type | None = None, outer_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, inner_lr: float | None = None, weight_decay: float | None = None,
                 outer_lr: float | None = None, outer_momentum: float | None = None, nesterov: bool | None = None,
                 drop_prob: float = 0.0, seed: int = 0, final_sync: bool = True, overlap: str = "paper",
                 max_norm: float | None = None,
                 **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=_one_of("lr", lr, "inner_lr", inner_lr),
                         weight_decay=weight_decay, **kwargs)
        spec, normalize = outer_choice(outer_optim_spec, outer_optim, outer_lr=outer_lr,
                                       outer_momentum=outer_momentum, nesterov=nesterov)
        if normalize:
            raise ValueError("StreamingDiLoCoStrategy does not offer 'sgd_normalized' (fragments are normalised "
                             "separately, which is not the same rule); use 'sgd' or another outer optimizer")
        self._use_modules([StreamingDiLoCoCommunicator(
            H, spec, num_fragments=num_fragments, fragment_pattern=fragment_pattern, tau=tau, alpha=alpha,
            drop_prob=drop_prob, seed=seed, quantization_bits=quantization_bits, compression=compression,
            final_sync=final_sync, overlap=overlap)])

    @property
    def H(self) -> int:
        """Steps between two syncs of the same fragment."""
        return self.modules[0].H
