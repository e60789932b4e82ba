"""The sim's one event queue: everything that happens next in simulated time, for the nodes and their messages.

Entries, ordered by (simulated time, kind, rank, sequence, the order they were pushed):
- a node that may run (kind RUN, at its clock): it computes from there to its next collective or observation. Runs
  come before every other kind at the same time, so a node that may still send at time t runs before anything at t
  happens; among equal clocks, in the order they came (a run without a time model keeps every clock at 0: its nodes
  take turns as they become ready);
- on a network with shared links (exogym.cluster.flows), a transfer's last byte leaving (kind FINISH: the flow that
  ends first, a message's or a collective's; stale once another flow started or ended, when the next one is pushed)
  and a transfer starting (kind START: a message at its sent_at, a collective at its last member's arrival): a flow
  ends before another starts at the same time, and both before anything arrives then, so a transfer alone on its
  links finishes as the formula says and nothing arrives out of its order;
- a message arriving (kind ARRIVE): at sent_at + its transfer time, ordered among equal times by the sender's rank
  (the server's, -1, first) and the sender's own count (the queue numbers each sender's messages as they come in:
  `Message.seq`);
- a server timer (kind ARRIVE, from SERVER with count -1: before the server's messages at its time);
- a node that wants to observe at its clock (kind OBSERVE, ordered by rank): a `recv`, a `poll` or a `read_server`,
  of a node of this process or (the keeper) of another process's.

Every key is fixed by simulated time, ranks and counts, never by the host's scheduling, so the same seed pops the
same entries in the same order. The runs are kept in a heap of their own beside the rest (a node is in it at most
once, and a checkpoint, taken while every node waits in a collective, holds none): `next_is_run` compares the two
fronts, so the queue is read as one order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

from exogym.cluster.flows import Flow
from exogym.cluster.network import SERVER, Network, Route
from exogym.comm.messages import Message

__all__ = ["RUN", "FINISH", "START", "ARRIVE", "OBSERVE", "EventQueue", "Timer", "CollectiveTransfer", "poster",
           "arrival", "message_plain", "message_from_plain"]

RUN, FINISH, START, ARRIVE, OBSERVE = -3, -2, -1, 0, 1


@dataclass(frozen=True)
class Timer:
    """A server timer (`Server.wake_at`): `wake(at)` runs at simulated time `at`."""

    at: float


@dataclass(eq=False)
class CollectiveTransfer:
    """A collective's transfer on shared links (exogym.cluster.flows), from its last member's arrival on.

    Args:
        start: When it starts: the last member's arrival.
        route: The links its algorithm occupies and the bytes it puts on them (Network.collective_route).
        leave: Sets the members' clocks once its flow has ended (TimeModel.leave_flow).
        first: The group's first rank (the queue orders equal starts by it).
        holders: The processes holding its members, ascending (over processes; empty in one process).
        waiting: This process's members that wait on it (the blocking ones).
        done: Lets the members run on (set by the baton).
        name: The collective's (group, sequence number), the same in every process holding a member (set by the
            baton).
        key: Its flow's key (set by the post office).
    """

    start: float
    route: Route
    leave: Callable[[Flow], None]
    first: int
    holders: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    done: Callable[[], None] | None = None
    name: tuple = ()
    key: tuple = ()


def poster(holders: tuple[int, ...], keeper: int) -> int:
    """Which process posts a collective's transfer to the keeper (over processes): the keeper itself when it holds a
    member (then no packet is needed), else the lowest process holding one (the group's lowest rank's: the exchange's
    leader, which knows the start first). Every holder computes the same route and start; one posts it."""
    return keeper if keeper in holders else holders[0]


class EventQueue:
    """The nodes that may run, the transfers in flight, the server's timers and the observations waiting for their
    turn."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._runs: list[tuple[float, int, int]] = []  # (clock, the order it came in, rank) of the nodes that may run
        self._came = itertools.count()
        self._order = itertools.count()
        self._sent: dict[int, int] = {}  # per sender, messages sent so far

    # ---- the nodes' runs --------------------------------------------------------------------------------
    def run(self, at: float, rank: int) -> None:
        """Node `rank` may run from its clock `at` (after the nodes that may run from the same clock already)."""
        heapq.heappush(self._runs, (at, next(self._came), rank))

    def has_runs(self) -> bool:
        return bool(self._runs)

    def has_events(self) -> bool:
        """Whether anything but a node's run is queued."""
        return bool(self._events)

    def next_is_run(self) -> bool:
        """Whether the earliest entry is a node's run."""
        if not self._runs:
            return False
        return not self._events or (self._runs[0][0], RUN) < self._events[0][:2]

    def first_run(self) -> int:
        """The rank of the earliest run (there is one)."""
        return self._runs[0][2]

    def pop_run(self) -> int:
        """Take the earliest run: its rank."""
        return heapq.heappop(self._runs)[2]

    # ---- the rest ---------------------------------------------------------------------------------------
    def _number(self, message: Message) -> None:
        message.seq = self._sent.get(message.src, 0)
        self._sent[message.src] = message.seq + 1

    def start(self, message: Message) -> None:
        """A message starts on the wire at its sent_at (shared links): in, numbered as its sender's next."""
        self._number(message)
        heapq.heappush(self._events, (message.sent_at, START, message.src, message.seq, next(self._order), message))

    def start_collective(self, at: float, key: tuple, item: CollectiveTransfer) -> None:
        """A collective's transfer starts at `at`, its last member's arrival (shared links). `key`: ("collective", its
        group's first rank, its (group, sequence number)): after the messages that rank starts at the same time, then
        by group and sequence number, not in the order pushed, which over processes is the order the transfers reached
        the keeper (the entries tied so far are collectives' starts only: the tuple compares with theirs)."""
        heapq.heappush(self._events, (at, START, key[1], math.inf, (key[2], next(self._order)), item))

    def finish(self, at: float, key: tuple, version: int) -> None:
        """The flow `key` (a message's (src, seq); a collective's ("collective", first rank, (group, sequence))) sends
        its last byte at `at`, unless the flows moved past `version`."""
        rank, seq = (key[0], key[1]) if key[0] != "collective" else (key[1], math.inf)
        heapq.heappush(self._events, (at, FINISH, rank, seq, next(self._order), (key, version)))

    def arrive(self, message: Message, numbered: bool = False) -> None:
        """A message on the wire, its arrival time set: in, numbered as its sender's next (unless it was when it
        started)."""
        if not numbered:
            self._number(message)
        heapq.heappush(self._events, (message.arrives_at, ARRIVE, message.src, message.seq, next(self._order),
                                      message))

    def timer(self, at: float) -> None:
        """The server's `wake(at)` at `at`."""
        heapq.heappush(self._events, (at, ARRIVE, SERVER, -1, next(self._order), Timer(at)))

    def observe(self, at: float, rank: int, item: Any) -> None:
        """Node `rank` observes at its clock `at` (`item`: the rank, or another process's question)."""
        heapq.heappush(self._events, (at, OBSERVE, rank, 0, next(self._order), item))

    def before(self, at: float, rank: int) -> bool:
        """Whether a run or an event comes before node `rank`'s observation at `at`."""
        return (bool(self._runs) and self._runs[0][0] <= at
                or bool(self._events) and self._events[0][:3] <= (at, OBSERVE, rank))

    def next_at(self) -> float:
        """The simulated time of the earliest event, runs aside (there is one)."""
        return self._events[0][0]

    def entries(self) -> list[tuple]:
        """The events, runs aside, as (time, kind, rank, sequence, push order, item), in no order (read only)."""
        return self._events

    def promote(self, entry: tuple) -> None:
        """Make `entry` (one of `entries()`) the next event, ahead of its time and of every run (the keeper's lookahead
        across processes, exogym.backends.sim.postlink, takes an arrival at a waiting node before events that cannot
        reach it)."""
        self._events.remove(entry)  # by identity: the push order makes every other entry differ before the item
        heapq.heapify(self._events)
        heapq.heappush(self._events, (-math.inf, *entry[1:]))

    def pop(self) -> tuple[int, Any]:
        """The earliest event, runs aside: (its kind, the message, the Timer, the flow's (key, version), the
        collective's start, or what the observation pushed)."""
        _, kind, _, _, _, item = heapq.heappop(self._events)
        return kind, item

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The events in flight, the push count and the senders' counts: plain data and tensors.

        Raises:
            RuntimeError: a node waits to observe (the checkpoint was not taken at a pause).
        """
        events = []
        for at, kind, _, seq, order, item in self._events:
            if kind == OBSERVE:
                raise RuntimeError(f"node {item} waits to observe at a checkpoint: the checkpoint was not taken "
                                   "while every node waited in its collective")
            if kind == START and seq == math.inf:
                raise RuntimeError("a collective's transfer is in flight at a checkpoint: the checkpoint was not taken "
                                   "while every node waited in its collective")
            if isinstance(item, Timer):
                events.append({"wake": item.at, "order": order})
            elif kind == FINISH:
                events.append({"finish": at, "key": list(item[0]), "version": item[1], "order": order})
            else:
                events.append({"message": message_plain(item), "order": order, **({"start": True} if kind == START
                                                                                   else {})})
        return {"events": events, "order": next(self._order) - 1, "sent": dict(self._sent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned (a post office's state holds its keys, among others)."""
        self._events = []
        for e in state["events"]:
            if "wake" in e:
                self._events.append((e["wake"], ARRIVE, SERVER, -1, e["order"], Timer(e["wake"])))
            elif "finish" in e:
                key = tuple(e["key"])  # a collective's: stale (none is in flight at a checkpoint)
                rank, seq = (key[0], key[1]) if key[0] != "collective" else (key[1], math.inf)
                self._events.append((e["finish"], FINISH, rank, seq, e["order"], (key, e["version"])))
            elif e.get("start"):
                m = message_from_plain(e["message"])
                self._events.append((m.sent_at, START, m.src, m.seq, e["order"], m))
            else:
                m = message_from_plain(e["message"])
                self._events.append((m.arrives_at, ARRIVE, m.src, m.seq, e["order"], m))
        heapq.heapify(self._events)
        self._order = itertools.count(state["order"] + 1)
        self._sent = dict(state["sent"])


def arrival(network: Network | None, message: Message) -> float:
    """When a message sent at message.sent_at arrives: after the network's transfer time (none without a network).
    Worked out in the sender's process, by the same arithmetic everywhere."""
    seconds = 0.0 if network is None else network.message_seconds(message.nbytes, message.src, message.dst)
    return message.sent_at + seconds


def message_plain(m: Message) -> dict[str, Any]:
    """A message as plain data and a tensor (for a checkpoint)."""
    return {"src": m.src, "dst": m.dst, "tensor": m.tensor, "tag": m.tag, "meta": dict(m.meta), "sent_at": m.sent_at,
            "arrives_at": m.arrives_at, "seq": m.seq}


def message_from_plain(d: dict[str, Any]) -> Message:
    """The message message_plain gave."""
    return Message(d["src"], d["dst"], d["tensor"], d["tag"], dict(d["meta"]), d["sent_at"], d["arrives_at"], d["seq"])
