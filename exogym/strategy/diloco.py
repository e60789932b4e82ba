"""DiLoCo: Distributed Low-Communication training (Douillard et al. 2023, arXiv 2311.08105)."""

from __future__ import annotations

import copy
import uuid
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.compression import Compressor, compressor_from
from exogym.comm.collectives import alive_ranks, all_reduce
from exogym.strategy.communicate_optimize_strategy import (CommunicationModule, ModularStrategy, compressor_state,
                                                           round_generator)
from exogym.comm.mean import mean_
from exogym.strategy.base import trainable_parameters
from exogym.strategy.optim import OptimSpec, ensure_optim_spec
from exogym.strategy.outer_model import kept_nodes, outer_model_for

__all__ = ["DiLoCoCommunicator", "DiLoCoStrategy", "outer_spec", "outer_choice"]

_DROP = 3  # salt of the random stream that decides dropped outer gradients


class DiLoCoCommunicator(CommunicationModule):
    """DiLoCo's round: pseudo-gradient, one all-reduce of it, the outer optimizer step, reset.

    Every H steps: pseudo-gradient (global model - local model), one all-reduce of it, the outer optimizer
    step on the global model (the same on every node, so nothing is broadcast), reset. The global model is an
    OuterModel (`exogym.strategy.outer_model`), kept on the CPU (it is touched once per round).
    With failures or an elastic pool, a round averages the pseudo-gradients of the nodes that are up; a node
    coming up gets the global model and the outer optimizer's state, and starts its round from it.

    Args:
        H: Inner steps per round.
        outer_optim_spec: The outer optimizer (default: SGD, lr 0.7, Nesterov momentum 0.9, the paper's).
        normalize: Rescale the averaged pseudo-gradient to unit L2 norm before the outer step
            (`"sgd_normalized"`).
        drop_prob: Each round each node's pseudo-gradient is lost with this probability p (nodes agree via a
            shared seed); the others' are averaged, every node still takes the outer step, and a dropped node
            continues from its own parameters instead of resetting.
        seed: The seed of the shared random stream that decides dropped pseudo-gradients.
        quantization_bits: 8 or 4: send the pseudo-gradients quantized (see `compression`).
        compression: A Compressor of `exogym.comm.compression` (e.g. `FP4Quantizer()`, or
            `ErrorFeedback(TopK(0.01, values=IntQuantizer(4)))`): the pseudo-gradients are sent compressed, by
            one all-gather, and every node averages the decoded ones in rank order (`exogym.comm.mean`). Bytes
            per node per round: (K-1) x sum over parameters of `compressor.nbytes(shape)`, instead of
            2 (K-1)/K x the model's bytes.
        weight_by_shard_size: Average the pseudo-gradients weighted by each node's shard size.
        final_sync: A run whose last step is not a round's last ends with one more (shorter) round, so the
            global model includes every step (counted like any round); False leaves those steps out of it.

    Raises:
        TypeError: An argument of the wrong type.
        ValueError: H < 1, `drop_prob` not in [0, 1), or a negative seed.
    """

    def __init__(self, H: int = 100, outer_optim_spec: OptimSpec | None = None, *, normalize: bool = False,
                 drop_prob: float = 0.0, seed: int = 0, quantization_bits: int | None = None,
                 compression: Compressor | None = None, weight_by_shard_size: bool = False, final_sync: bool = True):
        check_int("H", H, minimum=1)
        check_number("drop_prob", drop_prob, minimum=0.0)
        if drop_prob >= 1:
            raise ValueError(f"drop_prob must be < 1 (every pseudo-gradient would be lost), got {drop_prob!r}")
        check_int("seed", seed, minimum=0)
        for name, flag in (("weight_by_shard_size", weight_by_shard_size), ("final_sync", final_sync)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.H, self.normalize, self.drop_prob, self.seed = H, bool(normalize), drop_prob, seed
        self.compression = copy.deepcopy(compressor_from(quantization_bits, compression))  # its own memory
        self.outer_optim_spec = outer_spec(outer_optim_spec)
        self.weight_by_shard_size, self.final_sync = weight_by_shard_size, final_sync
        self._outer_key = uuid.uuid4().hex  # every node's copy of this module shares it: one outer model

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        self.outer = outer_model_for(self, self._outer_key, model, self.outer_optim_spec, normalize=self.normalize)

    @property
    def master(self) -> list[torch.nn.Parameter]:
        """The global model's parameters (the outer model's)."""
        return self.outer.master

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        if local_step % self.H == 0:
            self._round(local_step // self.H - 1)

    def finish(self, local_step: int) -> None:
        if self.final_sync and local_step % self.H:  # steps since the last round: one more, shorter, round
            self._round(local_step // self.H)

    def _round(self, round_index: int) -> None:
        up = alive_ranks()
        kept = [r for r in self.kept_nodes(round_index) if r in up]
        if not kept:
            return  # every pseudo-gradient of the round was lost: nothing to apply, nothing to send
        params = trainable_parameters(self.model)
        grads = self.outer.pseudo_gradient(params, keep=self.rank in kept)
        self._reduce(grads, kept)
        self.outer.step(grads, sync=round_index)
        if self.rank in kept:
            self.outer.merge(params)  # every node starts the next round from the new global model

    def kept_nodes(self, round_index: int) -> list[int]:
        """The nodes whose pseudo-gradient arrives in round `round_index` (all of them unless `drop_prob > 0`).

        Args:
            round_index: The round, counted from 0.

        Returns:
            The ranks kept, sorted.
        """
        return kept_nodes(self.num_nodes, self.drop_prob, round_generator(self.seed, round_index, _DROP)
                          if self.drop_prob else None)

    @torch.no_grad()
    def _reduce(self, grads: list[torch.Tensor], kept: list[int]) -> None:
        """Average the pseudo-gradients that arrived (in place). With weight_by_shard_size, a weighted mean:
        node i counts shard_size_i / (the kept nodes' total)."""
        if len(alive_ranks()) == 1:
            return
        total: float = len(kept)
        if self.weight_by_shard_size:
            weight = float(self.context.shard_size)
            mine = torch.tensor([weight if self.rank in kept else 0.0], dtype=torch.float64)
            total = all_reduce(mine).item()  # 8 bytes a round: the kept nodes' total weight
            for g in grads:
                g.mul_(weight)
        keys = [("outer", i) if self.rank in kept else None for i in range(len(grads))]
        mean_(grads, self.compression, members=kept, divisor=total,
              **({"keys": keys} if self.compression is not None else {}))

    def global_state(self, local_step: int) -> Mapping[str, torch.Tensor]:
        return self.outer.global_state()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {"global": {"outer": self.outer.state_dict()},
                "local": {"compression": compressor_state(self.compression)}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        self.outer.load_state_dict(state["global"]["outer"])
        if self.compression is not None:
            self.compression.load_state_dict(state["local"]["compression"])

    def joined(self) -> None:
        self.outer.merge(trainable_parameters(self.model))  # the joiner's round starts from the global model
        if self.compression is not None:
            self.compression.load_state_dict({})  # the survivor's unsent error is not the joiner's


def outer_spec(outer_optim_spec: OptimSpec | str | type | None = None, *, outer_lr: float | None = None,
               outer_momentum: float | None = None, nesterov: bool | None = None) -> OptimSpec:
    """The outer optimizer: by default SGD, lr 0.7, Nesterov momentum 0.9 (the paper's); a name or class
    with outer_lr (SGD also takes outer_momentum and nesterov), or a full OptimSpec alone."""
    check_number("outer_lr", outer_lr, positive=True, allow_none=True, finite=True)
    check_number("outer_momentum", outer_momentum, minimum=0.0, allow_none=True)
    if outer_momentum is not None and outer_momentum >= 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
    if nesterov is not None and not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
    sgd = outer_optim_spec is None or outer_optim_spec is torch.optim.SGD or (
        isinstance(outer_optim_spec, str) and outer_optim_spec.lower() == "sgd")
    if isinstance(outer_optim_spec, OptimSpec) or not sgd:
        if outer_momentum is not None or nesterov is not None:
            raise TypeError(f"outer_momentum and nesterov configure the default outer SGD; with "
                            f"outer_optim={outer_optim_spec!r} put momentum settings into an OptimSpec")
        return ensure_optim_spec(outer_optim_spec, lr=outer_lr)
    momentum = 0.9 if outer_momentum is None else outer_momentum
    nesterov = momentum > 0 if nesterov is None else nesterov
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs outer_momentum > 0; pass nesterov=False for plain outer SGD")
    return OptimSpec(torch.optim.SGD, lr=0.7 if outer_lr is None else outer_lr, momentum=momentum, nesterov=nesterov)


class DiLoCoStrategy(ModularStrategy):
    """DiLoCo: H inner steps on every node, then an outer optimizer step on the averaged parameter deltas.

    Every node takes H inner steps (AdamW by default) from the global model; then the nodes' parameter deltas
    are averaged (one all-reduce) and an outer optimizer (Nesterov SGD) moves the global model, the same way on
    every node; every node starts the next round from it.

    Paper: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
    Bytes per node per round: 2 (K-1)/K x the model's bytes (ring all-reduce); per step, that over H.
    A node whose pseudo-gradient is dropped (`drop_prob`) keeps its local progress and continues from it.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default AdamW, lr 1e-3).
        outer_optim_spec: The outer optimizer: `"sgd"` (default), `"sgd_normalized"` (SGD on the unit-norm
            pseudo-gradient), any optimizer name or class (with `outer_lr`), or an OptimSpec.
        H: Inner steps per round.
        inner_optim: The same as `optim_spec`, as the original documents spell it (pass one of them).
        outer_optim: The same as `outer_optim_spec` (pass one of them).
        lr: The inner optimizer's learning rate.
        inner_lr: The same as `lr` (pass one of them).
        weight_decay: The inner optimizer's weight decay.
        outer_lr: The outer optimizer's learning rate (default 0.7).
        outer_momentum: The outer SGD's momentum (default 0.9).
        nesterov: Whether the outer SGD's momentum is Nesterov's (default True).
        drop_prob: Each round each node's pseudo-gradient is lost with this probability (nodes agree via a shared
            seed); the others' are averaged, and a dropped node continues from its own parameters.
        seed: The seed of the shared random stream that decides dropped pseudo-gradients.
        weight_by_shard_size: Average the pseudo-gradients weighted by each node's number of training examples
            (the paper's data-size weighting, for unequal shards: dataset factories or non-IID splits).
        quantization_bits: 8 or 4: send the pseudo-gradients quantized (see `compression`).
        compression: A Compressor of `exogym.comm.compression`: the pseudo-gradients are sent compressed, by one
            all-gather (see DiLoCoCommunicator); bytes per node per round (K-1) x the compressed model's bytes.
        final_sync: When the run's last step is not the end of a round, the nodes synchronise once more, so the
            returned model and the final validation include every step (a run shorter than H is one short
            round); False returns the global model of the last full round.
        max_norm: Clip the global gradient norm to this before each inner step.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
                    `cosine_anneal`, `min_lr_factor`), and, after an optimizer name or class, that optimizer's own
                    options (`momentum=0.9`, `betas=...`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: Both spellings of an option are given, or an unknown keyword.
        ValueError: A value out of range (H < 1, `drop_prob` not in [0, 1), ...).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None,
                 outer_optim_spec: OptimSpec | str | type | None = None, *, H: int = 100,
                 inner_optim: OptimSpec | str | type | None = None, outer_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, inner_lr: float | None = None, weight_decay: float | None = None,
                 outer_lr: float | None = None, outer_momentum: float | None = None, nesterov: bool | None = None,
                 drop_prob: float = 0.0, seed: int = 0, weight_by_shard_size: bool = False,
                 quantization_bits: int | None = None, compression: Compressor | None = None,
                 final_sync: bool = True, max_norm: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=_one_of("lr", lr, "inner_lr", inner_lr),
                         weight_decay=weight_decay, **kwargs)
        self._use_modules([diloco_module(H, outer_optim_spec, outer_optim, outer_lr=outer_lr,
                                         outer_momentum=outer_momentum, nesterov=nesterov, drop_prob=drop_prob,
                                         seed=seed, quantization_bits=quantization_bits, compression=compression,
                                         weight_by_shard_size=weight_by_shard_size, final_sync=final_sync)])

    @property
    def H(self) -> int:
        """Inner steps per round."""
        return self.modules[0].H


def outer_choice(outer_optim_spec: Any, outer_optim: Any, **kwargs: Any) -> tuple[OptimSpec, bool]:
    """(outer OptimSpec, normalize) from a strategy's two outer-optimizer spellings and outer_lr/momentum/nesterov;
    "sgd_normalized" is SGD on the unit-norm pseudo-gradient."""
    if outer_optim_spec is not None and outer_optim is not None:
        raise TypeError(f"got both outer_optim_spec={outer_optim_spec!r} and outer_optim={outer_optim!r}; "
                        "pass one of them")
    name = outer_optim_spec if outer_optim_spec is not None else outer_optim
    normalize = isinstance(name, str) and name.lower() == "sgd_normalized"
    return outer_spec("sgd" if normalize else name, **kwargs), normalize


def diloco_module(H: int, outer_optim_spec: Any, outer_optim: Any, **kwargs: Any) -> DiLoCoCommunicator:
    """A DiLoCoCommunicator from a strategy's arguments (both outer optimizer spellings, "sgd_normalized")."""
    module_kwargs = {k: kwargs.pop(k) for k in ("drop_prob", "seed", "quantization_bits", "compression",
                                                 "weight_by_shard_size", "final_sync") if k in kwargs}
    spec, normalize = outer_choice(outer_optim_spec, outer_optim, **kwargs)
    return DiLoCoCommunicator(H, spec, normalize=normalize, **module_kwargs)


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    if value is not None and alias_value is not None:
        raise TypeError(f"got both {name}={value!r} and {alias}={alias_value!r}; they are the same setting, pass one")
    return value if value is not None else alias_value
