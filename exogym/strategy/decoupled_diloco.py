"""Decoupled DiLoCo: learners on their own clocks send parameter fragments to a syncer, which merges what has
arrived with a minimum quorum, an adaptive grace window and token-weighted averaging."""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

import torch

from exogym._validation import caller_level, check_int, check_number
from exogym.comm.collectives import ranks_up_from
from exogym.comm import messages as msg
from exogym.strategy.base import Strategy
from exogym.strategy.optim import OptimSpec
from exogym.strategy.server_rounds import JOIN, FlatServer, ServerRoundsStrategy, flat_parameters, load_flat

__all__ = ["DecoupledDiLoCoStrategy", "Syncer"]


class Syncer(FlatServer):
    """The global model theta in F fragments, each with its own version, outer momentum and pending contributions.

    A learner's fragment-p message (its pseudo-gradient Delta_p and weight w = the inner steps it took since it
    last sent fragment p, i.e. its tokens at a fixed batch) joins fragment p's pending set (one learner sending
    twice adds up). Once `min_quorum` learners are pending, the syncer waits a grace window for more
    (adaptive: grace_factor x the time the quorum took to form, at most max_grace), then merges:
    Delta = sum_m w_m Delta_m / sum_m w_m, m_p <- beta m_p + Delta, theta_p <- theta_p - lr (Delta + beta m_p)
    (Nesterov). It merges at once when every learner is pending. Each message is answered at once with theta_p
    as it stands.
    """

    def __init__(self, theta: torch.Tensor, num_nodes: int, *, H: int, fragments: int, min_quorum: int,
                 grace_factor: float, max_grace: float, outer_lr: float, outer_momentum: float):
        super().__init__(theta, num_nodes, H, dynamic_local_updates=False)
        self.slices = fragment_slices(theta.numel(), fragments)
        self.quorum, self.grace_factor, self.max_grace = min_quorum, grace_factor, max_grace
        self.lr, self.beta = outer_lr, outer_momentum
        self.momentum = torch.zeros_like(self.theta)
        self.versions = [0] * fragments
        self.pending: list[dict[int, list[Any]]] = [{} for _ in range(fragments)]  # node -> [Delta, w, staleness]
        self.first_at: list[float | None] = [None] * fragments
        self.deadline: list[float | None] = [None] * fragments

    def receive(self, message: msg.Message) -> None:
        if message.tag == JOIN:  # a learner coming back: the whole model, and each fragment's version
            self.send(message.src, self.theta, meta={"version": self.version, "H": self.H,
                                                     **{f"v{p}": v for p, v in enumerate(self.versions)}})
            return
        p = int(message.meta["fragment"])
        staleness = self.versions[p] - int(message.meta["version"])
        entry = self.pending[p].setdefault(message.src, [torch.zeros_like(message.tensor), 0.0, 0])
        entry[0].add_(message.tensor)
        entry[1] += message.meta["steps"]
        entry[2] = max(entry[2], staleness)
        if self.first_at[p] is None:
            self.first_at[p] = self.now
        if len(self.pending[p]) == self.num_nodes:
            self._merge(p, message.src)
        elif len(self.pending[p]) >= self.quorum and self.deadline[p] is None:
            grace = min(self.max_grace, self.grace_factor * (self.now - self.first_at[p]))
            self.deadline[p] = self.now + grace
            self.wake_at(self.deadline[p])
        sl = self.slices[p]
        self.send(message.src, self.theta[sl], meta={"version": self.versions[p], "H": self.H})

    def wake(self, at: float) -> None:
        for p, deadline in enumerate(self.deadline):
            if deadline == at:
                self._merge(p, -1)

    def _merge(self, p: int, node: int) -> None:
        pending = self.pending[p]
        total = sum(w for _, w, _ in pending.values())
        delta = sum(d * (w / total) for d, w, _ in pending.values())  # ranks in arrival order of first contribution
        sl = self.slices[p]
        m = self.momentum[sl]
        m.mul_(self.beta).add_(delta)
        self.theta[sl].sub_(delta + self.beta * m, alpha=self.lr)
        self.versions[p] += 1
        self.version += 1
        self.record_update(node=node, fragment=p, quorum=len(pending), staleness=max(s for _, _, s in pending.values()),
                           weight=total, version=self.versions[p])
        self.pending[p], self.first_at[p], self.deadline[p] = {}, None, None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momentum": self.momentum.clone(), "versions": list(self.versions),
                "pending": [{r: [d.clone(), w, s] for r, (d, w, s) in p.items()} for p in self.pending],
                "first_at": list(self.first_at), "deadline": list(self.deadline)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum.copy_(state["momentum"])
        self.versions = list(state["versions"])
        self.pending = [{r: [d.clone(), w, s] for r, (d, w, s) in p.items()} for p in state["pending"]]
        self.first_at, self.deadline = list(state["first_at"]), list(state["deadline"])


def fragment_slices(n: int, fragments: int) -> list[slice]:
    """F contiguous, nearly equal slices of the flat parameter vector (the first n mod F one element longer)."""
    bounds = [n * i // fragments for i in range(fragments + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class DecoupledDiLoCoStrategy(ServerRoundsStrategy):
    """Decoupled DiLoCo: learners on their own clocks send fragments to a syncer that merges them by quorum.

    Every node (learner) trains on its own clock and, every H/F inner steps, sends the next of its F parameter
    fragments' pseudo-gradients (round robin) to a syncer, taking that fragment of the global model back. The
    syncer merges each fragment's pending contributions once a minimum quorum has arrived and an adaptive grace
    window has passed, weighting each learner by its tokens; failed or slow learners never stall it.

    Paper: Douillard et al., "Decoupled DiLoCo for Resilient Distributed Pre-training", arXiv:2604.21428, 2026.
    What follows its text: learners on their own clocks, fragments sent round robin every H/F inner steps, a syncer
    that merges a fragment once a minimum quorum of learners has sent it and a grace window has passed, the merge
    weighted by each learner's tokens, a Nesterov outer step per fragment. This project's reading where the paper
    leaves room (Syncer has the rule as implemented): the grace window's adaptation (grace_factor x the time the
    quorum took to form, at most max_grace); a merge at once when every learner is pending; a learner that sends
    a fragment twice before its merge adds up; tokens are inner steps at a fixed batch; a fragment's staleness is
    the largest of its pending contributions'; each learner gets the fragment back at once, as it stands; the
    default quorum is half the nodes, rounded up. It hands out no tasks, so the asynchronous Local-SGD framework's
    task options (dynamic local updates, shard sampling, inner_state) are AsyncDiLoCo's and FedBuff's, not its.

    Bytes per update: a learner sends M/F (+32 bytes of meta) and receives M/F every H/F steps: 2 M / H per step,
    DiLoCo's, with a peak of M/F per message.

    Args:
        optim_spec: The inner optimizer (default AdamW, lr 1e-3).
        H: Inner steps between two syncs of one fragment.
        lr: The inner optimizer's learning rate.
        fragments: F, the number of fragments (H must be a multiple of F).
        min_quorum: Learners a merge needs (default: half the nodes, rounded up).
        grace_factor: The grace window after the quorum formed is grace_factor x the time it took to form.
        max_grace: The grace window's longest, in seconds.
        outer_lr: The syncer's Nesterov outer step's learning rate.
        outer_momentum: The syncer's Nesterov outer step's momentum.
        max_norm: Clip each inner step's gradient norm.
        time_budget_s: A node sits out its remaining steps once its clock (simulated seconds, or the run's
            seconds without a time model) reaches this (fast nodes then train more steps than slow ones in the same
            time; None: every node trains max_steps).
        **kwargs: The Strategy's options (`lr_scheduler`, ...).

    Raises:
        ValueError: H, fragments or min_quorum below 1, H not a multiple of fragments, a negative grace, a
            min_quorum above num_nodes (at the start of the run).
    """

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, *, H: int = 100, lr: float | None = None,
                 fragments: int = 1, min_quorum: int | None = None, grace_factor: float = 0.5,
                 max_grace: float = math.inf, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 time_budget_s: float | None = None, max_norm: float | None = None, **kwargs: Any):
        task_options = sorted(k for k in ("dynamic_local_updates", "min_local_steps", "shard_sampling", "shard_seed",
                                          "inner_state") if k in kwargs)
        if task_options:  # the syncer hands out fragments, not tasks: these would silently mean nothing
            raise ValueError(f"DecoupledDiLoCoStrategy has no {', '.join(task_options)} (AsyncDiLoCoStrategy and "
                             "FedBuffStrategy do): its syncer merges fragments and hands out no tasks")
        super().__init__(optim_spec, H=H, lr=lr, time_budget_s=time_budget_s, max_norm=max_norm, **kwargs)
        check_int("fragments", fragments, minimum=1)
        if H % fragments:
            raise ValueError(f"H must be a multiple of fragments (each fragment syncs every H/F steps); got H={H}, "
                             f"fragments={fragments}; use H={H - H % fragments or fragments}")
        check_int("min_quorum", min_quorum, minimum=1, allow_none=True)
        check_number("grace_factor", grace_factor, minimum=0.0)
        check_number("max_grace", max_grace, minimum=0.0)
        check_number("outer_lr", outer_lr, positive=True, finite=True)
        check_number("outer_momentum", outer_momentum, minimum=0.0)
        if outer_momentum >= 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        self.fragments, self.min_quorum = fragments, min_quorum
        self.grace_factor, self.max_grace = grace_factor, max_grace
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum

    def check_nodes(self, num_nodes: int) -> None:
        if self.min_quorum is not None and self.min_quorum > num_nodes:
            raise ValueError(f"min_quorum={self.min_quorum} is more than num_nodes={num_nodes}; use at most "
                             f"{num_nodes}")

    def make_server(self, theta: torch.Tensor, num_nodes: int) -> Syncer:
        """The run's syncer, made once where it runs.

        Args:
            theta: The global model's trainable parameters, flat.
            num_nodes: The run's node count.

        Returns:
            The Syncer.
        """
        quorum = self.min_quorum if self.min_quorum is not None else max(1, math.ceil(num_nodes / 2))
        return Syncer(theta, num_nodes, H=self.H, fragments=self.fragments, min_quorum=quorum,
                      grace_factor=self.grace_factor, max_grace=self.max_grace, outer_lr=self.outer_lr,
                      outer_momentum=self.outer_momentum)

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        super()._init_node(model, rank, num_nodes)
        self._slices = fragment_slices(self._start.numel(), self.fragments)
        self._versions = [0] * self.fragments
        self._since = [0] * self.fragments  # inner steps since each fragment was last sent
        self._next = 0  # the fragment sent next

    def step(self) -> None:
        if self._stopped:
            Strategy.step(self)
            return
        self._clip_grads()
        self.optim.step()
        self._steps += 1
        self._since = [s + 1 for s in self._since]
        if self._steps >= self.H // self.fragments:
            self._sync(self._next)
            self._next = (self._next + 1) % self.fragments
            self._steps = 0
        Strategy.step(self)  # the LR schedule and the step count (ServerRoundsStrategy.step's round is not ours)

    @torch.no_grad()
    def _sync(self, p: int) -> None:
        """Send fragment p's pseudo-gradient (the global fragment it started from minus the node's), take the
        syncer's fragment p as the node's and as its new start."""
        self._warn_if_no_quorum()
        sl = self._slices[p]
        flat = flat_parameters(self.model)
        msg.send(self._start[sl] - flat[sl], msg.SERVER,
                 meta={"version": self._versions[p], "steps": self._since[p], "fragment": p}, copy=False)
        reply = msg.recv(src=msg.SERVER)
        self._start[sl] = reply.tensor
        flat[sl] = reply.tensor
        load_flat(self._params, flat)
        self._versions[p], self._since[p] = int(reply.meta["version"]), 0

    def _warn_if_no_quorum(self) -> None:
        """Once per run: fewer nodes than the quorum will ever be up again (the others gone for good), so the syncer
        can never merge again; the run goes on (its nodes train alone), and this says why nothing merges."""
        quorum = self.min_quorum if self.min_quorum is not None else max(1, math.ceil(self.num_nodes / 2))
        if getattr(self, "_quorum_warned", False):
            return
        left = ranks_up_from(self.local_step + 1)
        if len(left) < quorum:
            self._quorum_warned = True
            if self.rank != min(left, default=self.rank):
                return  # one node says it for the run: the lowest still up
            warnings.warn(f"Decoupled DiLoCo's min_quorum={quorum} can no longer form: only {len(left)} node(s) are "
                          f"ever up again (the others are gone for good), so the syncer never merges again; use a "
                          f"min_quorum of at most {len(left)} for this failure schedule", RuntimeWarning,
                          stacklevel=caller_level())

    @torch.no_grad()
    def rejoin_alone(self) -> None:
        msg.send(torch.zeros(0, dtype=self._start.dtype), msg.SERVER, tag=JOIN)
        reply = msg.recv(src=msg.SERVER)
        self._start = reply.tensor
        load_flat(self._params, reply.tensor)
        self._versions = [int(reply.meta[f"v{p}"]) for p in range(self.fragments)]
        self._since, self._steps = [0] * self.fragments, 0

    def finish(self) -> None:
        """Each fragment with unsent steps is sent, then the nodes meet once, at the end."""
        for p in range(self.fragments):
            if self._since[p]:
                self._sync(p)
        from exogym.comm.collectives import barrier
        barrier()

    def state_dict(self) -> dict[str, dict[str, Any]]:
        state = super().state_dict()
        state["local"].update(versions=list(self._versions), since=list(self._since), next=self._next)
        return state

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)
        local = state["local"]
        self._versions, self._since, self._next = list(local["versions"]), list(local["since"]), local["next"]
