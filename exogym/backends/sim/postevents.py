"""The event heap of the sim's messages: what happens next in simulated time.

Events, in one heap ordered by (simulated time, kind, rank, sequence, the order they were pushed):
- on a network with shared links (exogym.cluster.flows), a message's last byte leaving (kind FINISH: the flow that
  ends first; stale once another flow started or ended, when the next one is pushed) and a message starting (kind START, at its
  sent_at, ordered likewise): a flow ends before another starts at the same time, and both before anything arrives
  then, so a transfer alone on its links finishes as the formula says and nothing arrives out of its order;
- a message arriving (kind ARRIVE): at sent_at + the network's transfer time, ordered among equal times by the
  sender's rank (the server's, -1, first) and the sender's own count (the heap numbers each sender's messages as
  they come in: `Message.seq`);
- a server timer (kind ARRIVE, from SERVER with count -1: before the server's messages at its time);
- a node that wants to observe at its clock (kind OBSERVE, ordered by rank): a `recv`, a `poll` or a
  `read_server`, of a node of this process or (the hub) of another process's.

Every key is fixed by simulated time, ranks and counts, never by the host's scheduling, so the same seed pops the
same events in the same order (exogym.backends.sim.postoffice says when the next one may be popped).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Any

from exogym.cluster.network import SERVER
from exogym.comm.messages import Message

__all__ = ["FINISH", "START", "ARRIVE", "OBSERVE", "EventHeap", "Timer", "arrival", "message_plain",
           "message_from_plain"]

FINISH, START, ARRIVE, OBSERVE = -2, -1, 0, 1


@dataclass(frozen=True)
class Timer:
    """A server timer (`Server.wake_at`): `wake(at)` runs at simulated time `at`."""

    at: float


class EventHeap:
    """The messages in flight, the server's timers and the observations waiting for their turn."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._order = itertools.count()
        self._sent: dict[int, int] = {}  # per sender, messages sent so far

    def __bool__(self) -> bool:
        return bool(self._events)

    def _number(self, message: Message) -> None:
        message.seq = self._sent.get(message.src, 0)
        self._sent[message.src] = message.seq + 1

    def start(self, message: Message) -> None:
        """A message starts on the wire at its sent_at (shared links): in, numbered as its sender's next."""
        self._number(message)
        heapq.heappush(self._events, (message.sent_at, START, message.src, message.seq, next(self._order), message))

    def finish(self, at: float, key: tuple[int, int], version: int) -> None:
        """The flow of message `key` (src, seq) sends its last byte at `at`, unless the flows moved past `version`."""
        heapq.heappush(self._events, (at, FINISH, key[0], key[1], next(self._order), (key, version)))

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
        """Whether an event comes before node `rank`'s observation at `at`."""
        return bool(self._events) and self._events[0][:3] <= (at, OBSERVE, rank)

    def next_at(self) -> float:
        """The simulated time of the earliest event (the heap is not empty)."""
        return self._events[0][0]

    def entries(self) -> list[tuple]:
        """The events as (time, kind, rank, sequence, push order, item), in no order (read only)."""
        return self._events

    def promote(self, entry: tuple) -> None:
        """Make `entry` (one of `entries()`) the next to pop, ahead of its time (the hub's lookahead across processes,
        exogym.backends.sim.postlink, takes an arrival at a waiting node before events that cannot reach it)."""
        self._events.remove(entry)  # by identity: the push order makes every other entry differ before the item
        heapq.heapify(self._events)
        heapq.heappush(self._events, (-math.inf, *entry[1:]))

    def pop(self) -> tuple[int, Any]:
        """The earliest event: (its kind, the message, the Timer, or what the observation pushed)."""
        _, kind, _, _, _, item = heapq.heappop(self._events)
        return kind, item

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The events in flight, the push count and the senders' counts: plain data and tensors.

        Raises:
            RuntimeError: a node waits to observe (the checkpoint was not taken at a pause).
        """
        events = []
        for at, kind, _, _, order, item in self._events:
            if kind == OBSERVE:
                raise RuntimeError(f"node {item} waits to observe at a checkpoint: the checkpoint was not taken "
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
                key = tuple(e["key"])
                self._events.append((e["finish"], FINISH, key[0], key[1], e["order"], (key, e["version"])))
            elif e.get("start"):
                m = message_from_plain(e["message"])
                self._events.append((m.sent_at, START, m.src, m.seq, e["order"], m))
            else:
                m = message_from_plain(e["message"])
                self._events.append((m.arrives_at, ARRIVE, m.src, m.seq, e["order"], m))
        heapq.heapify(self._events)
        self._order = itertools.count(state["order"] + 1)
        self._sent = dict(state["sent"])


def arrival(network: Any, message: Message) -> float:
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
