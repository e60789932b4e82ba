"""Gossip: no server; every node averages its parameters with its neighbours' on a topology."""

from __future__ import annotations

import math
import random
from typing import Any, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm import messages as msg
from exogym.comm.collectives import alive_ranks, sum_as_bookkeeping
from exogym.strategy.base import Strategy, trainable_parameters
from exogym.strategy.optim import OptimSpec, ensure_optim_spec
from exogym.strategy.server_rounds import TimeBudget, flat_parameters, load_flat

__all__ = ["GossipStrategy", "TOPOLOGIES", "neighbours"]

TOPOLOGIES = ("ring", "torus", "exponential", "random_pairs")


def _grid(k: int) -> tuple[int, int]:
    rows = max(d for d in range(1, int(math.isqrt(k)) + 1) if k % d == 0)
    return rows, k // rows


def neighbours(topology: str, rank: int, k: int, round_: int, seed: int) -> tuple[list[int], list[int]]:
    """(the nodes `rank` sends to, the nodes it receives from) in gossip round `round_` (from 0):
    ring: i-1 and i+1; torus: the four neighbours on a rows x cols grid with wrap-around (rows the largest
    divisor of K not above sqrt K); exponential: one peer, i + 2^j (receiving from i - 2^j), j = round mod the
    number of powers of 2 below K; random_pairs: a perfect matching drawn from (seed, round), the odd node out
    alone. Each list without the node itself and without repeats."""
    if k == 1:
        return [], []
    if topology == "ring":
        peers = sorted({(rank - 1) % k, (rank + 1) % k} - {rank})
        return peers, peers
    if topology == "torus":
        rows, cols = _grid(k)
        r, c = divmod(rank, cols)
        peers = sorted({((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c, r * cols + (c - 1) % cols,
                        r * cols + (c + 1) % cols} - {rank})
        return peers, peers
    if topology == "exponential":
        hop = 2 ** (round_ % max(1, math.ceil(math.log2(k))))
        return [(rank + hop) % k], [(rank - hop) % k]
    order = list(range(k))
    random.Random(seed * 1_000_003 + round_).shuffle(order)
    i = order.index(rank)
    partner = order[i ^ 1] if (i ^ 1) < k else None
    return ([partner], [partner]) if partner is not None else ([], [])


class GossipStrategy(TimeBudget, Strategy):
    """Gossip (decentralized) SGD: local steps, and every H steps a mix with the neighbours on a topology.

    Each node takes a local optimizer step, and every H steps mixes its parameters with its neighbours' on a
    topology (ring, torus, exponential graph, random pairs). No server, no all-reduce.

    `mode="sync"` (D-PSGD; Lian et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?",
    NeurIPS 2017): in gossip round r every node sends its parameters to its neighbours, waits for theirs and takes
    the uniform average x_i <- (x_i + sum_j x_j) / (1 + |N_i|) (the exponential graph: x_i <- (x_i + x_{i-2^j}) / 2).
    `mode="async"`: no node waits. Asynchronous gossip as push-sum (GoSGD, Blot et al. 2016; the asynchronous
    setting of AD-PSGD, Lian et al., ICML 2018, without its atomic pairwise average, which needs a thread on the
    peer): each node keeps a weight w_i (1 at the start); at its gossip points it folds in every message that has
    arrived, x_i <- (w_i x_i + sum w_j x_j) / (w_i + sum w_j), w_i <- w_i + sum w_j, then halves w_i and sends
    (x_i, w_i) to one neighbour (a random one of its own seeded stream; the exponential graph's next peer). The
    weights sum to K at all times, so the nodes converge to the plain average. At the end every message in flight
    is taken in.

    Bytes per gossip round: sync, each node sends M to every out-neighbour (ring 2M, torus up to 4M, exponential
    and random pairs M) and receives as much; async, M + 8 bytes to one neighbour.

    Failures and elastic pools: a node that is down takes no part. Sync: a round mixes each node up with its
    neighbours up at that step (a node whose neighbours are all down keeps its model), and a node coming back
    takes the mean of the nodes that stayed up, handed over by them (`exogym.engine.rejoin`). Async: a node
    sends to a neighbour up at its step (none up: it keeps its weight); one that is down spends its steps idle on
    its clock, and comes back alone, with its own model and weight, folding in what reached it meanwhile; at the
    end the nodes up take in every message still in flight from each other (a message to or from a node down at
    the end is left out, with its weight).

    Args:
        optim_spec: The local optimizer (default SGD, lr 0.01).
        topology: `"ring"`, `"torus"`, `"exponential"` or `"random_pairs"`.
        mode: `"sync"` or `"async"`.
        H: Local steps between gossip rounds.
        lr: The local optimizer's learning rate.
        seed: The random pairs' and the async peers' streams.
        time_budget_s: Async only: a node sits out its remaining steps once its simulated clock reaches this.
        max_norm: Clip each local step's gradient norm.
        **kwargs: The Strategy's options (`lr_scheduler`, ...).

    Raises:
        ValueError: An unknown topology or mode, H below 1.
    """

    _default_inner = OptimSpec(torch.optim.SGD, lr=0.01)
    collectives_match_steps = True
    sends_messages = True

    @property
    def clock_runs_while_down(self) -> bool:
        """Async: a node down spends its steps idle and comes back at its time; not once it has stopped at its
        time budget. Sync: the hand-over's collectives bring a node coming back to the others' time."""
        return self.mode == "async" and not self._stopped

    @property
    def rejoins_alone(self) -> bool:
        """Async: a node coming back rejoins alone (see the class docstring); sync: the nodes up hand it over."""
        return self.mode == "async"

    def rejoin_alone(self) -> None:
        """Async: a node coming back takes what reached it while it was down (the class docstring)."""
        self._take_what_arrived()

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, topology: str = "ring",
                 mode: str = "sync", H: int = 1, lr: float | None = None, seed: int = 0,
                 time_budget_s: float | None = None, max_norm: float | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology must be one of {list(TOPOLOGIES)}, got {topology!r}")
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        check_int("H", H, minimum=1)
        check_int("seed", seed, minimum=0)
        check_number("time_budget_s", time_budget_s, positive=True, allow_none=True)
        if time_budget_s is not None and mode != "async":
            raise ValueError("time_budget_s needs mode='async': in sync gossip a node that stops would leave its "
                             "neighbours waiting")
        self.time_budget_s = time_budget_s
        self.topology, self.mode, self.H, self.seed = topology, mode, H, seed
        spec = ensure_optim_spec(optim_spec, lr=lr) if optim_spec is not None else None
        self.optim_spec = spec or OptimSpec(self._default_inner.cls, **{**self._default_inner.kwargs,
                                                                        **({} if lr is None else {"lr": lr})})

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self._params = trainable_parameters(model)
        self._round, self._weight = 0, 1.0
        self._rng = random.Random(self.seed * 7919 + rank)
        self._sent = torch.zeros(num_nodes, dtype=torch.int64)  # async: messages sent to each node
        self._taken = torch.zeros(num_nodes, dtype=torch.int64)  # async: messages taken from each node
        self._stopped = False

    def step(self) -> None:
        if self._stopped:
            super().step()
            return
        self._clip_grads()
        self.optim.step()
        if (self.local_step + 1) % self.H == 0 and self.num_nodes > 1:
            self._sync_round() if self.mode == "sync" else self._push()
            self._round += 1
        super().step()

    @torch.no_grad()
    def _sync_round(self) -> None:
        out, into = neighbours(self.topology, self.rank, self.num_nodes, self._round, self.seed)
        up = set(alive_ranks())  # every node up at this step makes this round: the same sets on both sides
        out, into = [j for j in out if j in up], [j for j in into if j in up]
        x = flat_parameters(self.model)
        works = [msg.isend(x, j, tag=self._round) for j in out]
        total = x.clone()
        for j in into:
            total += msg.recv(src=j, tag=self._round).tensor
        for w in works:
            w.wait()
        load_flat(self._params, total / (1 + len(into)))

    @torch.no_grad()
    def _fold(self, messages: list[msg.Message]) -> None:
        """Push-sum: fold the arrived (x_j, w_j) into (x_i, w_i)."""
        if not messages:
            return
        x = flat_parameters(self.model) * self._weight
        for m in messages:
            x += m.tensor * m.meta["w"]
            self._weight += m.meta["w"]
            self._taken[m.src] += 1
        load_flat(self._params, x / self._weight)

    @torch.no_grad()
    def _take_what_arrived(self) -> None:
        self._fold(msg.poll())

    @torch.no_grad()
    def _push(self) -> None:
        self._fold(msg.poll())
        out, _ = neighbours(self.topology, self.rank, self.num_nodes, self._round, self.seed)
        if self.topology == "random_pairs":
            out = [r for r in range(self.num_nodes) if r != self.rank]
        up = set(alive_ranks())
        out = [j for j in out if j in up]  # (without failures, all of them: the same draws)
        if not out:  # every neighbour is down: the weight stays here
            return
        if self.topology != "exponential":
            out = [self._rng.choice(out)]
        self._weight /= 2
        msg.isend(flat_parameters(self.model), out[0], meta={"w": self._weight}, copy=False)  # a fresh flat copy
        self._sent[out[0]] += 1

    def finish(self) -> None:
        """Async: every message still in flight from a node up is taken in, so no weight is lost between them.

        The nodes up sum how many messages each sent to each node (K counts per node, bookkeeping: no bytes, no
        simulated time), so node i knows how many were sent to it; it receives until it has taken that many from
        nodes up (a message from a node down at the end is left out, with its weight), then folds them in per
        sender in rank order, each sender's in arrival order."""
        if self.mode != "async" or self.num_nodes == 1:
            return
        up = alive_ranks()
        sent_to = sum_as_bookkeeping(self._sent.clone())  # [K]: messages the nodes up sent to each node
        missing = int(sent_to[self.rank]) - sum(int(self._taken[j]) for j in up)
        by_sender: dict[int, list[msg.Message]] = {}
        while missing > 0:
            m = msg.recv()
            if m.src in up:
                by_sender.setdefault(m.src, []).append(m)
                missing -= 1
        for j in sorted(by_sender):
            self._fold(by_sender[j])

    def validation_facts(self) -> dict[str, float]:
        """A validation row's simulated time: node 0's clock when it validated (the nodes' clocks differ)."""
        return {"sim_time_s": msg.now()}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        state["local"].update(round=self._round, weight=self._weight, rng=self._rng.getstate(),
                              sent=self._sent.clone(), taken=self._taken.clone(), stopped=self._stopped)
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        local = state["local"]
        self._round, self._weight = local["round"], local["weight"]
        self._rng.setstate(local["rng"])
        self._sent, self._taken = local["sent"].clone(), local["taken"].clone()
        self._stopped = local["stopped"]
