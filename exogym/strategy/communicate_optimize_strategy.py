"""Composable strategies: an inner optimizer step, then a list of communication modules.

`CommunicateOptimizeStrategy([SparseCommunicator(p_sparta=0.01), DiLoCoCommunicator(H=100)], "adamw", lr=3e-4)`
is SPARTA-DiLoCo. After every step each module decides for itself whether to communicate
(every step, every H steps...), in list order, on every node alike. DiLoCo, FedAvg, SPARTA and
SPARTA-DiLoCo are thin subclasses that build their modules from their arguments.

The modules live beside their strategies: averaging (FedAvg) in federated_averaging.py, SPARTA's in
sparta.py, DiLoCo's in diloco.py, Streaming DiLoCo's in streaming_diloco.py.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from exogym._validation import check_number
from exogym.comm.compression import Compressor
from exogym.adapters import Adaptable
from exogym.comm.collectives import Group, new_group
from exogym.strategy.context import NodeContext
from exogym.strategy.optim import OptimSpec, ensure_optim_spec, pop_optimizer_options
from exogym.strategy.base import Strategy, frozen_state, strategy_keywords

__all__ = ["CommunicationModule", "CommunicateOptimizeStrategy", "ModularStrategy",
           "round_generator"]


class CommunicationModule(metaclass=Adaptable):
    """One kind of communication, run after every inner step of a CommunicateOptimizeStrategy.

    `communicate(model, rank, num_nodes, local_step)` is called on every node after its
    `local_step`-th inner step (counted from 1), so "every H steps" is `local_step % H == 0` and the
    first synchronisation follows exactly H inner steps. It may only use `exogym.comm.collectives`,
    and every node must make the same collective calls in the same order.

    The state protocol is the strategy's (see Strategy): `state_dict()` / `load_state_dict()` with "global"
    and "local" parts, `joined()`, `global_state()`, `model_sources()`, `finish()`.
    """

    supports_membership_changes = True  # False: cannot run with failures or an elastic pool
    # True: some nodes sit whole rounds out (skip their compute, join no collective of other modules); such a
    # module must be a strategy's only one.
    sits_nodes_out = False

    def setup(self, model: torch.nn.Module, context: NodeContext) -> None:
        """Bind to one node's model (each node has its own deep copy of the module), once, before the first step.

        Args:
            model: This node's model.
            context: The node's context (see `Strategy.setup`).
        """
        self.context = context
        self._init_node(model, context.rank, context.num_nodes)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        """Bind to one node's model; modules extend this (the run's facts are in self.context)."""

    def check_nodes(self, num_nodes: int) -> None:
        """Before any node starts: raise if the module's settings cannot work with `num_nodes`.

        See `Strategy.check_nodes`.

        Args:
            num_nodes: The run's node count.

        Raises:
            ValueError: In a subclass, when its settings cannot work with `num_nodes`.
        """

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        """Communicate after this node's `local_step`-th inner step, if the module's schedule says so.

        Called on every node up after each inner step; every node must make the same collective calls in the same
        order.

        Args:
            model: This node's model.
            rank: This node's rank.
            num_nodes: The run's node count.
            local_step: The inner steps this node has done, counted from 1.
        """
        raise NotImplementedError

    def finish(self, local_step: int) -> None:
        """After the run's last inner step (on the nodes up): complete what the schedule left pending.

        Args:
            local_step: The inner steps done.
        """

    def skip_compute(self, local_step: int) -> bool:
        """Whether this node sits out inner step `local_step` (see `Strategy.skip_compute`).

        Args:
            local_step: The coming inner step, counted from 1.

        Returns:
            True when the node takes no inner step (it still runs the modules).
        """
        return False

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """{"global": ..., "local": ...} as Strategy.state_dict; a module without state has two empty parts."""
        return {"global": {}, "local": {}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore what `state_dict()` returned.

        Args:
            state: `{"global": ..., "local": ...}` as `state_dict()` returned it.
        """

    def joined(self) -> None:
        """On a node coming up, after it loaded a survivor's state (see Strategy.joined)."""

    def global_state(self, local_step: int) -> Mapping[str, torch.Tensor] | None:
        """The module's own global model after `local_step` steps, if it keeps one (see `Strategy.global_state`).

        Args:
            local_step: The inner steps done.

        Returns:
            State-dict entries of the global model, or None.
        """
        return None

    def model_sources(self, candidates: list[int], local_step: int) -> list[int] | None:
        """Which candidates' average is the global model, if this module decides it (see `Strategy.model_sources`).

        Args:
            candidates: The nodes up, or those that were up before nodes came up.
            local_step: The inner steps done.

        Returns:
            A sub-list of `candidates`, or None to leave the choice to the strategy.
        """
        return None

    def __repr__(self) -> str:
        # Its settings (what config.json shows), not what setup binds (model, optimizers, state).
        plain = (int, float, str, bool, type(None), OptimSpec, Compressor)
        knobs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, plain)
                          and k not in ("rank", "num_nodes"))
        return f"{type(self).__name__}({knobs})"

    def __getstate__(self) -> dict[str, Any]:
        # Caches are not state: groups may be torch.distributed process groups, which do not copy or pickle;
        # each node makes its own (and draws its own participants again).
        return {k: v for k, v in self.__dict__.items() if k not in ("_groups", "_participants")}

    def _group(self, ranks: Sequence[int]) -> Group:
        """The group of `ranks`, made once. Every node asks for the same groups in the same order
        (torch.distributed requires each new_group to be called by every process), so the caches agree."""
        groups = self.__dict__.setdefault("_groups", {})
        key = tuple(sorted(ranks))
        if key not in groups:
            groups[key] = new_group(key)
        return groups[key]


def round_generator(seed: int, round_index: int, salt: int) -> torch.Generator:
    """A CPU generator that every node seeds identically for the same (seed, round, purpose):
    nodes agree on random choices (samples, islands, indices) without sending them."""
    mixed = np.random.SeedSequence([seed, salt, round_index]).generate_state(1, dtype=np.uint64)[0] >> 1
    return torch.Generator().manual_seed(int(mixed))


def compressor_state(compressor: Compressor | None) -> dict[str, Any]:
    """A module's compressor memory (error feedback's residuals), for its local state."""
    return compressor.state_dict() if compressor is not None else {}


class ModularStrategy(Strategy):
    """Each step: clip, one inner optimizer step, then every communication module in order.

    The base of CommunicateOptimizeStrategy and of the named strategies built from modules (they
    call `_use_modules` in their constructor). The inner optimizer: optim_spec (an OptimSpec, a name
    such as "adamw", or an optimizer class), or inner_optim="adamw" (the same, as the original
    documents spell it), with lr and weight_decay. The global model is the first module's that keeps
    one (DiLoCo's outer model), else the nodes' average. A node that a module sits out of a step
    (FedAvg's client sampling) takes no inner step but still runs the modules.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default: the class's, AdamW at lr 1e-3 here).
        max_norm: Clip each step's gradient norm to this (None: no clipping).
        inner_optim: The same as `optim_spec`, as the original documents spell it (pass one of them).
        lr: The inner optimizer's learning rate.
        weight_decay: The inner optimizer's weight decay.
        **kwargs: The name form's optimizer options (`momentum=0.9` with `"sgd"`) and the Strategy base's
            settings (LR schedule, `lr_callbacks`, ...).

    Raises:
        TypeError: An optimizer given twice, or an option neither the optimizer nor the base takes.
        ValueError: A setting out of range (a learning rate that is not finite and positive, ...).
    """

    _default_inner = OptimSpec(torch.optim.AdamW, lr=1e-3)  # subclasses name the paper's

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        # The name form's options ("sgd", momentum=0.9) are the inner optimizer's; the rest are the base class's.
        options = pop_optimizer_options(type(self).__name__, optim_spec if optim_spec is not None else inner_optim,
                                        self._default_inner, kwargs, strategy_keywords(type(self)))
        super().__init__(max_norm=max_norm, **kwargs)
        self.optim_spec = inner_spec(optim_spec, inner_optim, self._default_inner, lr=lr, weight_decay=weight_decay,
                                     **options)
        self.modules: list[CommunicationModule] = []

    def _use_modules(self, communication_modules: Sequence[CommunicationModule]) -> None:
        modules = list(communication_modules) if isinstance(communication_modules, (list, tuple)) else None
        if modules is None or not all(isinstance(m, CommunicationModule) for m in modules):
            raise TypeError(f"communication_modules must be a list of CommunicationModule instances, "
                            f"got {communication_modules!r}")
        lone = [type(m).__name__ for m in modules if m.sits_nodes_out]
        if lone and len(modules) > 1:
            raise ValueError(f"{lone[0]} makes nodes sit whole rounds out (e.g. client_sampling < 1), so it must be "
                             "the only communication module: the others would need the nodes that sit out")
        self.modules = modules

    def check_nodes(self, num_nodes: int) -> None:
        for m in self.modules:
            m.check_nodes(num_nodes)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        for m in self.modules:
            m.setup(model, self.context)

    def skip_compute(self) -> bool:
        return any(m.skip_compute(self.local_step + 1) for m in self.modules)

    def step(self) -> None:
        skip = self.skip_compute()
        if not skip:
            self._clip_grads()
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)  # dead until the next backward: K nodes need not hold K copies
        for m in self.modules:
            m.communicate(self.model, self.rank, self.num_nodes, self.local_step + 1)
        with warnings.catch_warnings():
            if skip:  # the schedule follows the step count, also while the node's optimizer has not stepped yet
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            super().step()

    def finish(self) -> None:
        for m in self.modules:
            m.finish(self.local_step)

    def global_state(self) -> Mapping[str, torch.Tensor] | None:
        frozen = frozen_state(self.model)  # the same on every node: no module sends or changes them
        for m in self.modules:
            state = m.global_state(self.local_step)
            if state is not None:
                return {**frozen, **state}
        return frozen or None

    def model_sources(self, candidates: list[int], steps_done: int) -> list[int]:
        for m in self.modules:
            sources = m.model_sources(candidates, steps_done)
            if sources is not None:
                return sources
        return super().model_sources(candidates, steps_done)

    @property
    def supports_membership_changes(self) -> bool:
        return all(m.supports_membership_changes for m in self.modules)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        parts = [m.state_dict() for m in self.modules]
        state["global"]["modules"] = [p["global"] for p in parts]
        state["local"]["modules"] = [p["local"] for p in parts]
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        for m, g, loc in zip(self.modules, state["global"]["modules"], state["local"]["modules"]):
            m.load_state_dict({"global": g, "local": loc})

    def joined(self) -> None:
        for m in self.modules:
            m.joined()


class CommunicateOptimizeStrategy(ModularStrategy):
    """Your own hybrid: an inner optimizer step, then a list of communication modules.

    `CommunicateOptimizeStrategy([SparseCommunicator(0.01), DiLoCoCommunicator(H=100)], "adamw", lr=3e-4)`.
    Each step: clip, one inner optimizer step (AdamW, lr 1e-3 by default), then each module in list order
    communicates when its schedule says so; bytes are the sum of the modules'. The global model is the first
    module's that keeps one (DiLoCo's outer model), else the nodes' average.

    Args:
        communication_modules: The CommunicationModule instances, run in list order after every inner step.
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default AdamW, lr 1e-3).
        max_norm: Clip the global gradient norm to this before each inner step.
        inner_optim: The same as `optim_spec`, as the original documents spell it (pass one of them).
        lr: The inner optimizer's learning rate.
        weight_decay: The inner optimizer's weight decay.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
                    `cosine_anneal`, `min_lr_factor`), and, after an optimizer name or class, that optimizer's own
                    options (`momentum=0.9`, `betas=...`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: `communication_modules` is not a list of CommunicationModule instances, both `optim_spec` and
            `inner_optim` are given, or an unknown keyword.
        ValueError: A module that sits nodes out (FedAvg's client sampling) is not the only module.
    """

    def __init__(self, communication_modules: Sequence[CommunicationModule],
                 optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules(communication_modules)


def inner_spec(optim_spec: OptimSpec | str | type | None, inner_optim: OptimSpec | str | type | None,
               default: OptimSpec, *, lr: float | None, weight_decay: float | None, **options: Any) -> OptimSpec:
    """The inner optimizer from either spelling (optim_spec= or inner_optim=), with lr / weight_decay and,
    for a name or class, the optimizer's other options (momentum=0.9, betas=...)."""
    if optim_spec is not None and inner_optim is not None:
        raise TypeError(f"got both optim_spec={optim_spec!r} and inner_optim={inner_optim!r}; pass one of them")
    check_number("lr", lr, positive=True, allow_none=True, finite=True)
    check_number("weight_decay", weight_decay, minimum=0.0, allow_none=True, finite=True)
    return ensure_optim_spec(optim_spec if optim_spec is not None else inner_optim, default,
                             lr=lr, weight_decay=weight_decay, **options)
