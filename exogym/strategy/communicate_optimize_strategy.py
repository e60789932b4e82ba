"""Composable strategies: an inner optimizer step, then a list of communication modules.

`CommunicateOptimizeStrategy([SparseCommunicator(p_sparta=0.01), DiLoCoCommunicator(H=100)], "adamw", lr=3e-4)`
is SPARTA-DiLoCo. After every step each module decides for itself whether to communicate
(every step, every H steps...), in list order, on every node alike. DiLoCo, FedAvg, SPARTA and
SPARTA-DiLoCo are thin subclasses that build their modules from their arguments.

The averaging module is here; the SPARTA and DiLoCo modules live in sparta.py and diloco.py.
"""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from exogym._validation import check_int, check_number
from exogym.averaging import mean_over
from exogym.comm import current_communicator, current_membership, nodes_up
from exogym.compression import Compressor, compressor_from
from exogym.flatten import flatten_by_dtype, unflatten_into
from exogym.strategy.communicate import Group, alive_ranks, all_reduce, broadcast, new_group
from exogym.strategy.compressed_reduce import compressed_mean
from exogym.strategy.optim import OptimSpec, ensure_optim_spec
from exogym.strategy.strategy import Strategy

__all__ = ["CommunicationModule", "CommunicateOptimizeStrategy", "ModularStrategy", "AveragingCommunicator"]


class CommunicationModule:
    """One kind of communication, run after every inner step of a CommunicateOptimizeStrategy.

    `communicate(model, rank, num_nodes, local_step)` is called on every node after its
    `local_step`-th inner step (counted from 1), so "every H steps" is `local_step % H == 0` and the
    first synchronisation follows exactly H inner steps. It may only use exogym.strategy.communicate,
    and every node must make the same collective calls in the same order.
    """

    max_steps: int | None = None  # the run's last step, set by the strategy before _init_node
    keeps_global_model = False  # True: global_state() is the global model, the same on every node (DiLoCo's)
    supports_membership_changes = True  # False: cannot run with failures or an elastic pool

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        """Bind to one node's model (each node has its own deep copy of the module)."""

    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        raise NotImplementedError

    def skip_compute(self, local_step: int) -> bool:
        """True: this node sits out inner step `local_step` (see Strategy.skip_compute)."""
        return False

    def global_state(self, local_step: int) -> Mapping[str, torch.Tensor] | None:
        """The module's own global model after `local_step` steps, if it keeps one (see Strategy.global_state).
        Every node calls this together, so it may use a collective of exogym.comm, uncounted (a measurement)."""
        return None

    def model_sources(self, survivors: list[int], local_step: int) -> list[int] | None:
        """Which survivors' average is the global model a node coming up gets, if this module decides it."""
        return None

    def state_for_joiners(self) -> Any:
        """This module's state a node coming up needs (it is sent from a node that was up); see Strategy."""
        return None

    def load_state_from_survivor(self, state: Any) -> None:
        """On a node coming up, after the strategy has loaded the global model, optimizer and step count."""

    def __repr__(self) -> str:
        # Its settings (what config.json shows), not what _init_node binds (model, optimizers, state).
        plain = (int, float, str, bool, type(None), OptimSpec, Compressor)
        knobs = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and isinstance(v, plain)
                          and k not in ("rank", "num_nodes", "max_steps"))
        return f"{type(self).__name__}({knobs})"

    def __getstate__(self) -> dict[str, Any]:
        # Groups may be torch.distributed process groups, which do not pickle; a resumed run makes them again
        # (and draws its participants again).
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


_SAMPLE, _ISLANDS = 1, 2  # salts: independent streams for sampling and for islands


class AveragingCommunicator(CommunicationModule):
    """Every H steps, model averaging: each node's parameters become the mean over its island.

    island_size=None: one island of every taking-part node; otherwise, each round, the nodes are
    shuffled (shared seed) into islands of island_size and average only within them (one subgroup
    all-reduce each). client_sampling=C < 1: each round only max(1, round(C*K)) sampled nodes train
    and average (drawn from the nodes up when the round starts, under failures or an elastic pool);
    the others do no compute, and the nodes sampled for the next round that sat this one out receive
    the new average from a sampled node at the round's end (one broadcast each).

    quantization_bits=8 or 4 / compression=<exogym.compression Compressor>: each node sends its change since
    the last average (theta_i - theta_last), compressed; every node decodes all of them and moves the
    shared theta_last by their mean (exogym.strategy.compressed_reduce), so the models stay identical.
    Bytes per node per round: (K-1) x sum over parameters of compressor.nbytes(shape) (one all-gather).
    Needs one island of all nodes (theta_last must be the same on every node).
    """

    def __init__(self, H: int = 1, *, island_size: int | None = None, client_sampling: float = 1.0, seed: int = 0,
                 quantization_bits: int | None = None, compression: Compressor | None = None):
        check_int("H", H, minimum=1)
        check_int("island_size", island_size, minimum=1, allow_none=True)
        check_number("client_sampling", client_sampling, positive=True, maximum=1.0)
        check_int("seed", seed, minimum=0)
        self.H, self.island_size, self.client_sampling, self.seed = H, island_size, client_sampling, seed
        self.compression = copy.deepcopy(compressor_from(quantization_bits, compression))  # its own memory
        if self.compression is not None and (island_size is not None or client_sampling < 1):
            raise ValueError(f"compressed averaging sends each node's change since the last average, which needs "
                             f"every node to share that average: drop island_size={island_size!r} and "
                             f"client_sampling={client_sampling!r}, or drop the compression")

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        m = self.clients_per_round
        if self.island_size is not None and (self.island_size > m or m % self.island_size):
            sizes = [d for d in range(1, m + 1) if m % d == 0]
            raise ValueError(f"island_size must divide the {m} nodes taking part in a round (num_nodes={num_nodes}"
                             f", client_sampling={self.client_sampling}), got {self.island_size}; use one of {sizes}")
        if self.compression is not None:  # theta_last: the model every node held after the last average
            self.last_average = [p.detach().clone() for p in model.parameters()]

    # ---- who takes part, with whom (the same answer on every node) ------------------------------
    @property
    def clients_per_round(self) -> int:
        return max(1, round(self.client_sampling * self.num_nodes))

    def participants(self, round_index: int) -> list[int]:
        """The sorted ranks that train in round `round_index` (rounds count from 0), sampled from the nodes up
        when the round starts (with failures or an elastic pool; otherwise from every node). Without sampling,
        every node: one coming up mid-round trains the rest of it."""
        if self.clients_per_round == self.num_nodes:
            return list(range(self.num_nodes))
        cache = self.__dict__.setdefault("_participants", {})  # asked every step: drawn once per round
        if round_index not in cache:
            pool = self._available(round_index)
            if self.clients_per_round < len(pool):
                perm = torch.randperm(len(pool), generator=round_generator(self.seed, round_index, _SAMPLE))
                pool = sorted(pool[i] for i in perm[:self.clients_per_round].tolist())
            if len(cache) > 2:  # only this round's and the next are asked for
                cache.clear()
            cache[round_index] = pool
        return list(cache[round_index])

    def _available(self, round_index: int) -> list[int]:
        membership = current_membership()
        if membership is None:
            return list(range(self.num_nodes))
        return list(membership.alive(round_index * self.H + 1))

    def islands(self, round_index: int) -> list[list[int]]:
        """The round's participants split into islands (each sorted); together they cover each participant once."""
        members = self.participants(round_index)
        if self.island_size is None or self.island_size == len(members):
            return [members]
        order = torch.randperm(len(members), generator=round_generator(self.seed, round_index, _ISLANDS)).tolist()
        shuffled = [members[i] for i in order]
        return [sorted(shuffled[i:i + self.island_size]) for i in range(0, len(shuffled), self.island_size)]

    def skip_compute(self, local_step: int) -> bool:
        return self.rank not in self.participants((local_step - 1) // self.H)

    # ---- one synchronisation -----------------------------------------------------------------
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        if local_step % self.H:
            return
        if self.compression is not None:
            self._average_compressed()
            return
        round_index = local_step // self.H - 1  # the round that ends with this step
        self._average_islands(self.islands(round_index))
        if self.clients_per_round < self.num_nodes:
            up = alive_ranks()
            self._hand_over([r for r in self.participants(round_index) if r in up],
                            [r for r in self.participants(round_index + 1) if r in up])

    @torch.no_grad()
    def _average_islands(self, islands: list[list[int]]) -> None:
        params = [p for p in self.model.parameters()]
        for island in islands:
            group = self._group(island)  # every node makes every island's group, in the same order
            if self.rank not in island:
                continue
            size = len(alive_ranks(group))  # its members that are up
            if size == 1:
                continue
            for flat, tensors in flatten_by_dtype(p.data for p in params):
                all_reduce(flat, group=group)
                flat.div_(size)
                unflatten_into(flat, tensors)

    @torch.no_grad()
    def _average_compressed(self) -> None:
        """theta_last += mean_j decode(encode(theta_j - theta_last)); theta_i = theta_last on every node."""
        if len(alive_ranks()) == 1:
            return
        params = list(self.model.parameters())
        changes = [p.detach() - last for p, last in zip(params, self.last_average)]
        keys = [("averaging", i) for i in range(len(params))]
        for p, last, mean in zip(params, self.last_average, compressed_mean(changes, self.compression, keys=keys)):
            last.add_(mean)
            p.copy_(last)

    @torch.no_grad()
    def _hand_over(self, done: list[int], upcoming: list[int]) -> None:
        """Each node sampled for the next round that sat this one out gets the new model from a node of this
        round (spread round-robin): a two-node broadcast, in which only the sender sends. Only nodes that are
        up take part (a node coming back up later gets the global model then, from exogym.rejoin)."""
        newcomers = [r for r in upcoming if r not in done] if done else []
        for i, newcomer in enumerate(newcomers):
            src = done[i % len(done)]
            group = self._group([src, newcomer])
            if self.rank not in (src, newcomer):
                continue
            for flat, tensors in flatten_by_dtype(p.data for p in self.model.parameters()):
                broadcast(flat, src=src, group=group)
                if self.rank == newcomer:
                    unflatten_into(flat, tensors)

    def global_state(self, local_step: int) -> Mapping[str, torch.Tensor] | None:
        """With client sampling, the average of the current round's participants (the unsampled nodes hold
        stale models). A measurement, as in exogym.averaging: it costs no bytes and no simulated time."""
        if self.clients_per_round == self.num_nodes:
            return None
        comm = current_communicator()
        up = nodes_up(comm)
        current = [r for r in self.participants(local_step // self.H) if r in up] or list(up)
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items() if v.is_floating_point()}
        for flat, tensors in flatten_by_dtype(state.values()):
            mean_over(flat, current, comm)
            unflatten_into(flat, tensors)
        return state

    def model_sources(self, survivors: list[int], local_step: int) -> list[int] | None:
        """With client sampling, the survivors training in the current round (the others hold stale models)."""
        if self.clients_per_round == self.num_nodes:
            return None
        current = [r for r in self.participants(local_step // self.H) if r in survivors]
        return current or survivors

    def state_for_joiners(self) -> Any:
        return [t.clone() for t in self.last_average] if self.compression is not None else None

    @torch.no_grad()
    def load_state_from_survivor(self, state: Any) -> None:
        if state is not None:
            for last, t in zip(self.last_average, state):
                last.copy_(t)


class ModularStrategy(Strategy):
    """Each step: clip, one inner optimizer step, then every communication module in order.

    The base of CommunicateOptimizeStrategy and of the named strategies built from modules (they
    call `_use_modules` in their constructor). The inner optimizer: optim_spec (an OptimSpec, a name
    such as "adamw", or an optimizer class), or inner_optim="adamw" (the same, as the original
    documents spell it), with lr and weight_decay. The global model is the first module's that keeps
    one (DiLoCo's outer model), else the nodes' average. A node that a module sits out of a step
    (FedAvg's client sampling) takes no inner step but still runs the modules.
    """

    _default_inner = OptimSpec(torch.optim.AdamW, lr=1e-3)  # subclasses name the paper's

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        self.optim_spec = inner_spec(optim_spec, inner_optim, self._default_inner, lr=lr, weight_decay=weight_decay)
        self.modules: list[CommunicationModule] = []

    def _use_modules(self, communication_modules: Sequence[CommunicationModule]) -> None:
        modules = list(communication_modules) if isinstance(communication_modules, (list, tuple)) else None
        if modules is None or not all(isinstance(m, CommunicationModule) for m in modules):
            raise TypeError(f"communication_modules must be a list of CommunicationModule instances, "
                            f"got {communication_modules!r}")
        if any(getattr(m, "client_sampling", 1.0) < 1.0 for m in modules) and len(modules) > 1:
            raise ValueError("an AveragingCommunicator with client_sampling < 1 must be the only communication "
                             "module: the other modules would need the unsampled nodes, which sit the round out")
        self.modules = modules

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        for m in self.modules:
            m.max_steps = getattr(self, "max_steps", None)
            m._init_node(model, rank, num_nodes)

    def skip_compute(self) -> bool:
        return any(m.skip_compute(self.local_step + 1) for m in self.modules)

    def step(self) -> None:
        skip = self.skip_compute()
        if not skip:
            self._clip_grads()
            self.optim.step()
        for m in self.modules:
            m.communicate(self.model, self.rank, self.num_nodes, self.local_step + 1)
        with warnings.catch_warnings():
            if skip:  # the schedule follows the step count, also while the node's optimizer has not stepped yet
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            super().step()

    def global_state(self) -> Mapping[str, torch.Tensor] | None:
        for m in self.modules:
            state = m.global_state(self.local_step)
            if state is not None:
                return state
        return None

    @property
    def supports_membership_changes(self) -> bool:
        return all(m.supports_membership_changes for m in self.modules)

    def _model_sources(self, survivors: list[int], steps_done: int) -> list[int]:
        if any(m.keeps_global_model for m in self.modules):
            return survivors[:1]  # the module's global model is the same on every node; joiners reset to it
        for m in self.modules:
            sources = m.model_sources(survivors, steps_done)
            if sources is not None:
                return sources
        return super()._model_sources(survivors, steps_done)

    def _state_for_joiners(self, sources: list[int]) -> dict[str, Any]:
        return {**super()._state_for_joiners(sources), "modules": [m.state_for_joiners() for m in self.modules]}

    def _load_state_from_survivor(self, state: dict[str, Any]) -> None:
        super()._load_state_from_survivor(state)
        for m, module_state in zip(self.modules, state["modules"]):
            m.load_state_from_survivor(module_state)


class CommunicateOptimizeStrategy(ModularStrategy):
    """Your own hybrid: `CommunicateOptimizeStrategy([SparseCommunicator(0.01), DiLoCoCommunicator(H=100)],
    "adamw", lr=3e-4)`. Each step: clip, one inner optimizer step (AdamW, lr 1e-3 by default), then each
    module in list order communicates when its schedule says so; bytes are the sum of the modules'.
    """

    def __init__(self, communication_modules: Sequence[CommunicationModule],
                 optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 inner_optim: OptimSpec | str | type | None = None, lr: float | None = None,
                 weight_decay: float | None = None, **kwargs: Any):
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules(communication_modules)


def inner_spec(optim_spec: OptimSpec | str | type | None, inner_optim: OptimSpec | str | type | None,
               default: OptimSpec, *, lr: float | None, weight_decay: float | None) -> OptimSpec:
    """The inner optimizer from either spelling (optim_spec= or inner_optim=), with lr / weight_decay."""
    if optim_spec is not None and inner_optim is not None:
        raise TypeError(f"got both optim_spec={optim_spec!r} and inner_optim={inner_optim!r}; pass one of them")
    check_number("lr", lr, positive=True, allow_none=True)
    check_number("weight_decay", weight_decay, minimum=0.0, allow_none=True)
    return ensure_optim_spec(optim_spec if optim_spec is not None else inner_optim, default,
                             lr=lr, weight_decay=weight_decay)
