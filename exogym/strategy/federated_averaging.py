"""FedAvg: local steps, then model averaging (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017), with islands and client sampling."""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.compression import Compressor, compressor_from
from exogym.flatten import flatten_by_dtype, unflatten_into
from exogym.strategy.communicate import alive_ranks, broadcast, in_running_node
from exogym.strategy.communicate_optimize_strategy import (CommunicationModule, ModularStrategy, compressor_state,
                                                           round_generator)
from exogym.strategy.mean import compressed_mean, mean_
from exogym.strategy.optim import OptimSpec

__all__ = ["AveragingCommunicator", "FedAvgStrategy"]

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
                 quantization_bits: int | None = None, compression: Compressor | None = None,
                 local_epochs: int | None = None):
        check_int("H", H, minimum=1)
        check_int("local_epochs", local_epochs, minimum=1, allow_none=True)
        self.local_epochs = local_epochs  # set: a round is local_epochs passes over the shard (H from the run)
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
        if self.local_epochs is not None:
            self.H = self.local_epochs * self.context.steps_per_epoch
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
        if not in_running_node():  # asked after or outside a run (to inspect the draws): every node
            return list(range(self.num_nodes))
        return alive_ranks(step=round_index * self.H + 1)

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
            mean_([p.data for p in params], group=group)

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

    def model_sources(self, candidates: list[int], local_step: int) -> list[int] | None:
        """With client sampling, the candidates training in the current round (the others hold stale models)."""
        if self.clients_per_round == self.num_nodes:
            return None
        current = [r for r in self.participants(local_step // self.H) if r in candidates]
        return current or list(candidates)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        shared = {"last_average": list(self.last_average)} if self.compression is not None else {}
        return {"global": shared, "local": {"compression": compressor_state(self.compression)}}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        if self.compression is not None:
            for last, t in zip(self.last_average, state["global"]["last_average"]):
                last.copy_(t)
            self.compression.load_state_dict(state["local"]["compression"])

    def joined(self) -> None:
        if self.compression is not None:
            self.compression.load_state_dict({})  # the survivor's unsent error is not the joiner's




class FedAvgStrategy(ModularStrategy):
    """FedAvg: every node takes H local steps (plain SGD by default), then the nodes' parameters are
    averaged (one all-reduce of the model) and every node continues from the average.

    Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data" (2017).
    Bytes per node per round: 2 (R-1)/R x the model's bytes, R = island_size or the nodes taking part;
    plus, with client sampling, the model once per node that joins the next round without this one.
    A node that drops keeps its local progress; the others average without it.

    island_size: each round the nodes are shuffled (shared seed) into islands that average only within.
    client_sampling=C: each round only max(1, round(C*K)) sampled nodes train and average; the others
        do no compute and send nothing (a 100-client run costs what its sampled clients do).
    local_epochs=E: a round is E passes over a node's shard (H = E x steps per epoch) instead of H steps.
    """

    _default_inner = OptimSpec(torch.optim.SGD, lr=0.01)

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 H: int | None = None, island_size: int | None = None, client_sampling: float = 1.0,
                 local_epochs: int | None = None, seed: int = 0, inner_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, weight_decay: float | None = None, **kwargs: Any):
        check_int("H", H, minimum=1, allow_none=True)
        check_int("local_epochs", local_epochs, minimum=1, allow_none=True)
        if H is not None and local_epochs is not None:
            raise TypeError(f"got both H={H!r} and local_epochs={local_epochs!r}; a round is either H steps or "
                            "local_epochs passes over the shard, pass one of them")
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules([AveragingCommunicator(1 if H is None else H, island_size=island_size,
                                                 client_sampling=client_sampling, seed=seed,
                                                 local_epochs=local_epochs)])

    @property
    def H(self) -> int:
        return self.modules[0].H
