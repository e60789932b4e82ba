"""FedAvg: local steps, then model averaging (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017), with islands and client sampling."""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.compression import Compressor, compressor_from
from exogym.comm.flatten import flatten_by_dtype, unflatten_into
from exogym.comm.collectives import alive_ranks, broadcast, in_running_node
from exogym.strategy.communicate_optimize_strategy import (CommunicationModule, ModularStrategy, compressor_state,
                                                           round_generator)
from exogym.comm.mean import compressed_mean, mean_
from exogym.strategy.base import trainable_parameters
from exogym.strategy.optim import OptimSpec

__all__ = ["AveragingCommunicator", "FedAvgStrategy"]

_SAMPLE, _ISLANDS = 1, 2  # salts: independent streams for sampling and for islands


def _clients_per_round(client_sampling: float, num_nodes: int) -> int:
    """How many nodes train and average in a round: a fraction client_sampling of them, at least one."""
    return max(1, round(client_sampling * num_nodes))


class AveragingCommunicator(CommunicationModule):
    """At the end of each round, model averaging: each node's parameters become the mean over its island.

    A round is H steps for every node; or, with `local_epochs`, E passes over each node's own shard (see
    below). With client sampling, the nodes sampled for the next round that sat this one out receive the new
    average from a sampled node at the round's end (one broadcast each).

    Args:
        H: A round is H steps for every node.
        island_size: None: one island of every taking-part node; otherwise, each round, the nodes are shuffled
            (shared seed) into islands of `island_size` and average only within them (one subgroup all-reduce
            each).
        client_sampling: C < 1: each round only max(1, round(C*K)) sampled nodes train and average (drawn from
            the nodes up when the round starts, under failures or an elastic pool); the others do no compute.
        seed: The seed of the shared random stream (islands, sampled clients).
        quantization_bits: 8 or 4: send the changes quantized (see `compression`).
        compression: A Compressor of `exogym.comm.compression`: each node sends its change since the last
            average (theta_i - theta_last), compressed; every node decodes all of them and moves the shared
            theta_last by their mean (`exogym.strategy.compressed_reduce`), so the models stay identical.
            Bytes per node per round: (K-1) x sum over parameters of `compressor.nbytes(shape)` (one
            all-gather). Needs one island of all nodes (theta_last must be the same on every node).
        local_epochs: E: node k runs E n_k/B steps a round (McMahan et al.'s Algorithm 1) and, when it finishes
            before the round's longest participant, sits out the rest of the round (no compute, no bytes, its
            clock idle).
        equal_local_steps: Give every node E x (the smallest shard / B) steps instead.
        weight_by_shard_size: Weight the average by each member's number of training examples n_k (the
            paper's n_k/n); with equal shards it is the plain mean, bit for bit.

    Raises:
        ValueError: A value out of range, or compression with islands.
    """

    def __init__(self, H: int = 1, *, island_size: int | None = None, client_sampling: float = 1.0, seed: int = 0,
                 quantization_bits: int | None = None, compression: Compressor | None = None,
                 local_epochs: int | None = None, equal_local_steps: bool = False, weight_by_shard_size: bool = False):
        check_int("H", H, minimum=1)
        check_int("local_epochs", local_epochs, minimum=1, allow_none=True)
        for name, value in (("equal_local_steps", equal_local_steps), ("weight_by_shard_size", weight_by_shard_size)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if equal_local_steps and local_epochs is None:
            raise ValueError("equal_local_steps=True chooses how many steps local_epochs gives each node; "
                             "pass local_epochs=E too, or drop equal_local_steps")
        self.local_epochs = local_epochs  # set: a round is local_epochs passes over the shard (H from the run)
        self.equal_local_steps, self.weight_by_shard_size = equal_local_steps, weight_by_shard_size
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
        ctx = self.context
        if (self.local_epochs is not None and not self.equal_local_steps or self.weight_by_shard_size) \
                and len(ctx.shard_sizes) != num_nodes:
            raise RuntimeError("AveragingCommunicator needs every node's shard size (NodeContext.shard_sizes and "
                               "shard_steps) for local_epochs or weight_by_shard_size; the node did not pass them")
        self._local_steps: list[int] | None = None  # per rank, when rounds are E passes over each node's own shard
        if self.local_epochs is not None:
            if self.equal_local_steps:  # every node E passes over the smallest shard
                self.H = self.local_epochs * ctx.steps_per_epoch
            else:
                self._local_steps = [self.local_epochs * n for n in ctx.shard_steps]
                self.H = max(self._local_steps)  # the longest round (what the config shows)
        self._round_ends = [0]  # _round_ends[r]: the last step before round r
        self.check_nodes(num_nodes)
        if self.compression is not None:  # theta_last: the model every node held after the last average
            self.last_average = [p.detach().clone() for p in trainable_parameters(model)]

    def check_nodes(self, num_nodes: int) -> None:
        """Check that `island_size` divides the nodes taking part in a round (fit checks this before any node starts).

        Args:
            num_nodes: The run's node count.

        Raises:
            ValueError: `island_size` does not divide the nodes taking part.
        """
        m = _clients_per_round(self.client_sampling, num_nodes)
        if self.island_size is not None and (self.island_size > m or m % self.island_size):
            small = [d for d in range(1, math.isqrt(m) + 1) if m % d == 0]  # sqrt(m) steps, however large m is
            sizes = small + [m // d for d in reversed(small) if d * d != m]
            raise ValueError(f"island_size must divide the {m} nodes taking part in a round (num_nodes={num_nodes}"
                             f", client_sampling={self.client_sampling}), got {self.island_size}; use one of {sizes}")

    # ---- rounds: which steps, who takes part, with whom (the same answer on every node) ------------------
    def _round_length(self, round_index: int) -> int:
        if self._local_steps is None:
            return self.H
        return max(self._local_steps[k] for k in self.participants(round_index))  # its longest participant

    def _start(self, round_index: int) -> int:
        """The last step before round `round_index` (0 for the first round)."""
        while len(self._round_ends) <= round_index:
            r = len(self._round_ends) - 1
            self._round_ends.append(self._round_ends[r] + self._round_length(r))
        return self._round_ends[round_index]

    def locate(self, step: int) -> tuple[int, int]:
        """Where step `step` falls: its round and its position within the round.

        Args:
            step: The step, counted from 1.

        Returns:
            `(round index, position within the round from 1)`.
        """
        if self._local_steps is None:
            return (step - 1) // self.H, (step - 1) % self.H + 1
        r = max(0, len(self._round_ends) - 2)
        while self._start(r + 1) < step:
            r += 1
        while r > 0 and self._start(r) >= step:  # asked about an earlier step (a resumed or rejoining node)
            r -= 1
        return r, step - self._start(r)

    def local_steps(self, rank: int) -> int:
        """How many steps node `rank` trains in a round it takes part in.

        Args:
            rank: The node.

        Returns:
            The node's steps per round.
        """
        return self.H if self._local_steps is None else self._local_steps[rank]

    @property
    def clients_per_round(self) -> int:
        """The nodes sampled each round: max(1, round(C*K)) with client sampling C."""
        return _clients_per_round(self.client_sampling, self.num_nodes)

    def participants(self, round_index: int) -> list[int]:
        """The sorted ranks that train in round `round_index`.

        Sampled from the nodes up when the round starts (with failures or an elastic pool; otherwise from every
        node). Without sampling, every node: one coming up mid-round trains the rest of it.

        Args:
            round_index: The round, counted from 0.

        Returns:
            The ranks, sorted.
        """
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
        return alive_ranks(step=self._start(round_index) + 1)

    def islands(self, round_index: int) -> list[list[int]]:
        """The round's participants split into islands (each sorted); together they cover each participant once.

        Args:
            round_index: The round, counted from 0.

        Returns:
            One sorted list of ranks per island.
        """
        members = self.participants(round_index)
        if self.island_size is None or self.island_size == len(members):
            return [members]
        order = torch.randperm(len(members), generator=round_generator(self.seed, round_index, _ISLANDS)).tolist()
        shuffled = [members[i] for i in order]
        return [sorted(shuffled[i:i + self.island_size]) for i in range(0, len(shuffled), self.island_size)]

    @property
    def sits_nodes_out(self) -> bool:
        """True with client sampling: unsampled nodes sit whole rounds out."""
        return self.client_sampling < 1

    def skip_compute(self, local_step: int) -> bool:
        round_index, position = self.locate(local_step)
        return self.rank not in self.participants(round_index) or position > self.local_steps(self.rank)

    # ---- one synchronisation -----------------------------------------------------------------
    def communicate(self, model: torch.nn.Module, rank: int, num_nodes: int, local_step: int) -> None:
        round_index, position = self.locate(local_step)  # the round that ends with this step, if it does
        if position < self._round_length(round_index):
            return
        if self.compression is not None:
            self._average_compressed()
            return
        self._average_islands(self.islands(round_index))
        if self.clients_per_round < self.num_nodes:
            up = alive_ranks()
            self._hand_over([r for r in self.participants(round_index) if r in up],
                            [r for r in self.participants(round_index + 1) if r in up])

    @torch.no_grad()
    def _average_islands(self, islands: list[list[int]]) -> None:
        params = trainable_parameters(self.model)  # frozen parameters are the same everywhere: not sent
        for island in islands:
            group = self._group(island)  # every node makes every island's group, in the same order
            if self.rank not in island:
                continue
            members = alive_ranks(group)  # its members that are up
            if self._share(members) is None:
                mean_([p.data for p in params], group=group)
            else:  # sum over members of n_k theta_k, divided by their n
                for p in params:
                    p.data.mul_(self.context.shard_sizes[self.rank])
                mean_([p.data for p in params], group=group,
                      divisor=sum(self.context.shard_sizes[r] for r in members))

    def _share(self, members: list[int]) -> float | None:
        """This node's weight n_k / (the members' n), or None for the plain mean (unweighted, or every member
        holding as many examples: then the plain mean is the weighted one, without its rounding)."""
        sizes = self.context.shard_sizes
        if not self.weight_by_shard_size or len({sizes[r] for r in members}) == 1:
            return None
        return sizes[self.rank] / sum(sizes[r] for r in members)

    @torch.no_grad()
    def _average_compressed(self) -> None:
        """theta_last += mean_j decode(encode(theta_j - theta_last)); theta_i = theta_last on every node."""
        members = alive_ranks()
        if len(members) == 1:
            return
        params = trainable_parameters(self.model)
        share = self._share(members)
        scale = 1.0 if share is None else share * len(members)  # the mean of K share_k change_k is the weighted mean
        changes = [(p.detach() - last) * scale for p, last in zip(params, self.last_average)]
        keys = [("averaging", i) for i in range(len(params))]
        for p, last, mean in zip(params, self.last_average, compressed_mean(changes, self.compression, keys=keys)):
            last.add_(mean)
            p.copy_(last)

    @torch.no_grad()
    def _hand_over(self, done: list[int], upcoming: list[int]) -> None:
        """Each node sampled for the next round that sat this one out gets the new model from a node of this
        round (spread round-robin): a two-node broadcast, in which only the sender sends. Only nodes that are
        up take part (a node coming back up later gets the global model then, from exogym.engine.rejoin)."""
        newcomers = [r for r in upcoming if r not in done] if done else []
        for i, newcomer in enumerate(newcomers):
            src = done[i % len(done)]
            group = self._group([src, newcomer])
            if self.rank not in (src, newcomer):
                continue
            for flat, tensors in flatten_by_dtype(p.data for p in trainable_parameters(self.model)):
                broadcast(flat, src=src, group=group)
                if self.rank == newcomer:
                    unflatten_into(flat, tensors)

    def model_sources(self, candidates: list[int], local_step: int) -> list[int] | None:
        """With client sampling, the candidates training in the current round (the others hold stale models).

        Args:
            candidates: The nodes up, or those that were up before nodes came up.
            local_step: The steps done.

        Returns:
            A sub-list of `candidates`, or None without client sampling.
        """
        if self.clients_per_round == self.num_nodes:
            return None
        current = [r for r in self.participants(self.locate(local_step + 1)[0]) if r in candidates]
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
    """FedAvg (McMahan et al.'s Algorithm 1): local training, then the nodes' parameters averaged each round.

    Each round every taking-part node trains locally (plain SGD by default), then the nodes' parameters are
    averaged, weighted by each node's number of training examples n_k (one all-reduce of the model), and every
    node continues from the average.

    Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data" (2017).
    Bytes per node per round: 2 (R-1)/R x the model's bytes, R = `island_size` or the nodes taking part;
    plus, with client sampling, the model once per node that joins the next round without this one.
    A node that drops keeps its local progress; the others average without it.

    Args:
        optim_spec: The inner optimizer: an OptimSpec, a name such as `"adamw"`, or an optimizer class
            (default plain SGD, lr 0.01).
        max_norm: Clip the global gradient norm to this before each local step.
        H: A round is H local steps on every node (default 1).
        island_size: Each round the nodes are shuffled (shared seed) into islands of this size that average
            only within; it must divide the nodes taking part.
        client_sampling: C: each round only max(1, round(C*K)) sampled nodes train and average; the others do
            no compute and send nothing (a 100-client run costs what its sampled clients do).
        local_epochs: E, instead of H: a round is E passes over each node's own shard, E n_k/B steps for node
            k; a node that finishes before the round's longest participant sits out the rest of the round (no
            compute, no bytes, its simulated clock idle).
        weight_by_shard_size: True (the paper): average weighted by n_k; False: the plain mean.
        equal_local_steps: With `local_epochs`, every node runs E x (the smallest shard / B) steps.
            `weight_by_shard_size=False` with `equal_local_steps=True` is the unweighted, equal-steps variant.
        seed: The seed of the shared random stream (islands, sampled clients).
        inner_optim: The same as `optim_spec` (pass one of them).
        lr: The local optimizer's learning rate.
        weight_decay: The local optimizer's weight decay.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
                    `cosine_anneal`, `min_lr_factor`), and, after an optimizer name or class, that optimizer's own
                    options (`momentum=0.9`, `betas=...`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: Both H and local_epochs, both spellings of an option, or an unknown keyword.
        ValueError: A value out of range.
    """

    _default_inner = OptimSpec(torch.optim.SGD, lr=0.01)

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 H: int | None = None, island_size: int | None = None, client_sampling: float = 1.0,
                 local_epochs: int | None = None, weight_by_shard_size: bool = True, equal_local_steps: bool = False,
                 seed: int = 0, inner_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, weight_decay: float | None = None, **kwargs: Any):
        check_int("H", H, minimum=1, allow_none=True)
        check_int("local_epochs", local_epochs, minimum=1, allow_none=True)
        if H is not None and local_epochs is not None:
            raise TypeError(f"got both H={H!r} and local_epochs={local_epochs!r}; a round is either H steps or "
                            "local_epochs passes over the shard, pass one of them")
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules([AveragingCommunicator(1 if H is None else H, island_size=island_size,
                                                 client_sampling=client_sampling, seed=seed, local_epochs=local_epochs,
                                                 equal_local_steps=equal_local_steps,
                                                 weight_by_shard_size=weight_by_shard_size)])

    @property
    def H(self) -> int:
        """Local steps per round.

        1 when neither H nor `local_epochs` is given, and with `local_epochs` (whose rounds are passes over each
        node's shard).
        """
        return self.modules[0].H
