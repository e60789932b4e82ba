"""The sim backend's point-to-point messages: a discrete-event queue on the simulated clock.

Events, in one heap ordered by (simulated time, kind, rank, sequence):
- a message arriving (kind 0): at sent_at + the network's transfer time, ordered among equal times by the
  sender's rank (the server's, -1, first) and the sender's own count; it goes into the receiver's mailbox, or,
  meant for the server, is handled by the server there and then (on the hub, between the nodes' turns);
- a node that wants to observe at its clock t (kind 1, ordered by rank): a `recv`, an `irecv`'s wait or a
  `read_server` first lets every event before t (and every message arriving at t) happen.

The invariant: whatever a node or the server reads (a message taken, the server's state) depends on simulated
time only. A node computes alone between observations, and its computation can reach another node only
through a message, which arrives at its own time and waits in the heap until every earlier event has
happened: the hub takes the next event only when no node is ready to run (the nodes that are ready have not
yet observed anything at their clocks, and every observation goes back through the heap). A two-node
interleaving that would break it without the heap: node 1 (clock 9) sends at 9 and arrives at 10 while node 0
(clock 2, not yet run) would send at 2 and arrive at 3; the server handling node 1's message first would apply
the updates out of order. With the heap, node 1's message waits at 10 while node 0 runs, and node 0's
arrives first.

Ties are broken by fixed keys (rank, then the sender's count), so the same seed gives the same bits however
the host schedules. Collectives and messages in one run: a node blocked in a collective is no event; the
messages it sends after leaving carry its clock from then on.

A run over several processes (fit(processes=P), torchrun with backend="sim"): the process holding the server role
(beside node 0) keeps this one heap, every mailbox and the server (it is the hub); the other processes' post offices
are proxies (exogym.backends.sim.postproxy) that send it their nodes' messages and observations and run a node
again when it answers. The hub takes the next event only when the whole run is quiescent, which is the rule above
with "no node ready" read across every process; exogym.backends.sim.postlink says why the exchange between the
processes cannot deliver a message out of order, so the run gives the bits one process gives.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Any, Callable

import torch

from exogym.backends.sim.postlink import Ask
from exogym.cluster.network import SERVER
from exogym.comm.messages import Message, Server, attach_server
from exogym.comm.transport import MessageError

if TYPE_CHECKING:
    from exogym.backends.sim.baton import Baton
    from exogym.backends.sim.postlink import Hub
    from exogym.cluster.simtime import TimeModel

__all__ = ["PostOffice", "SimSendWork", "SimRecvWork", "arrival"]

_ARRIVE, _OBSERVE = 0, 1
_WAKE = "wake"  # a server timer: an arrival-kind event from the server to itself


class PostOffice:
    """The messages in flight, the nodes' mailboxes and the run's server, for the nodes under one baton."""

    def __init__(self, baton: "Baton", num_nodes: int, time_model: "TimeModel | None"):
        self.baton, self.num_nodes = baton, num_nodes
        self.network = time_model.network if time_model is not None else None
        self.hub: "Hub | None" = None  # the other processes' nodes, when the run spans processes (set by the backend)
        self.undeclared = False  # the run spans processes without a hub: a message is an error (set by the backend)
        self.progress = 0  # events that happened (the deadlock check across processes)
        self._loaded = False  # a checkpoint's state is in (read before any node ran)
        self._saved_server: dict[str, Any] | None = None  # a checkpoint's server state, until the server is made
        self._events: list[tuple] = []
        self._order = itertools.count()
        self._mail: dict[int, list[Message]] = {r: [] for r in range(num_nodes)}
        self._wants: dict[int, tuple[int | None, int | None, str]] = {}  # rank -> (src, tag, what) it waits for
        self._sent: dict[int, int] = {}  # per sender, messages sent so far
        self.server: Server | None = None
        self.handled = 0  # messages the server has handled
        self.active = False  # a message was posted or a server declared: checkpoints pause the clocks
        self.handling: tuple[str, str] | None = None  # (the server's class, what) while a handler runs: the watchdog's

    # ---- the heap ------------------------------------------------------------------------------
    def has_events(self) -> bool:
        return bool(self._events)

    def busy(self) -> bool:
        """Whether the baton must go on for the messages: events to happen, or (the hub) other processes running."""
        return bool(self._events) or self.hub is not None and self.hub.unfinished()

    def due(self) -> bool:
        """Whether the next event may happen now (the baton asks when none of its nodes can run). In one process:
        whenever there is one. The hub: once the whole run is quiescent (exogym.backends.sim.postlink); then, with
        nothing left to happen, a node waiting for a message is a deadlock.

        Raises:
            MessageError: the run is quiescent, nothing is in flight, and some node waits in a recv.
        """
        if self.hub is None:
            return bool(self._events)
        if not self.hub.quiet(self.baton.crossings_started, set(self.baton.open_crossings)):
            return False
        if self._events:
            return True
        if self._wants:
            raise MessageError("deadlock: no message will ever arrive for the nodes waiting in recv (every other node "
                               "is finished or waits itself, and nothing is in flight):\n"
                               + "\n".join(self.describe_waiting()))
        return False

    def settle(self) -> None:
        """The baton has nothing to run (a proxy reports it to the hub; nothing to do here)."""

    def finish(self) -> None:
        """The baton's nodes are done: the hub waits for the link's threads."""
        if self.hub is not None:
            self.hub.close()

    def _check(self) -> None:
        if self.undeclared:
            raise MessageError("this run spans processes and its strategy sends point-to-point messages (or declares a "
                               "server) without saying so: set the class attribute sends_messages = True on the "
                               "strategy, so that the process holding node 0 keeps the run's one event heap")

    def post(self, message: Message) -> None:
        """Put a message on the wire at message.sent_at; it arrives after the network's transfer time."""
        self._check()
        message.arrives_at = arrival(self.network, message)
        self.push(message)

    def push(self, message: Message) -> None:
        """A message on the wire, its arrival time set (by the sender's process): into the heap, numbered as its
        sender's next."""
        self.active = True
        message.seq = self._sent.get(message.src, 0)
        self._sent[message.src] = message.seq + 1
        heapq.heappush(self._events, (message.arrives_at, _ARRIVE, message.src, message.seq, next(self._order),
                                      message))

    def next_event(self) -> None:
        """Let the earliest event happen (the hub calls it when no node is ready)."""
        _, kind, _, _, _, item = heapq.heappop(self._events)
        self.progress += 1
        if kind == _OBSERVE:
            if isinstance(item, Ask):
                self._answer(item)
            else:
                self.baton.wake(item)
        elif isinstance(item, tuple):  # (_WAKE, at): the server's timer
            self._run_server(f"its timer at {item[1]:.6g} s", item[1], lambda s: s.wake(item[1]))
        else:
            self._deliver(item)

    def observe(self, rank: int, at: float) -> None:
        """Node `rank` is about to read something at its clock `at`: every earlier event happens first."""
        self.baton.arrivals += 1  # progress, for the watchdog
        key = (at, _OBSERVE, rank)
        if self.hub is None and self.baton.idle_but(rank) and (not self._events or self._events[0][:3] > key):
            return  # nothing is due before it and no node is ready: it reads now, without a switch
        heapq.heappush(self._events, (at, _OBSERVE, rank, 0, next(self._order), rank))
        self.baton.sleep(rank)

    def ask(self, ask: Ask) -> None:
        """A node of another process observes at its clock (the hub): its turn comes in simulated-time order, as a
        node's here."""
        heapq.heappush(self._events, (ask.at, _OBSERVE, ask.rank, 0, next(self._order), ask))

    def _answer(self, ask: Ask) -> None:
        if ask.op == "poll":
            self.hub.answer(ask.rank, self.take_arrived(ask.rank, ask.src, ask.tag))
            return
        m = self._first(ask.rank, ask.src, ask.tag)
        if m is not None:
            self.hub.answer(ask.rank, m)
        else:
            self._wants[ask.rank] = (ask.src, ask.tag, ask.what)

    # ---- what the nodes' transports call ----------------------------------------------------------------
    def receive(self, rank: int, at: float, src: int | None, tag: int | None, what: Callable[[], str]) -> Message:
        """Node `rank`'s next message from `src` with `tag`, observed at its clock `at`: the first that has arrived,
        or the next to arrive."""
        self._check()
        self.observe(rank, at)
        return self.take(rank, src, tag, what)

    def arrived(self, rank: int, at: float, src: int | None, tag: int | None) -> list[Message]:
        """Every message for `rank` from `src` with `tag` that has arrived by its clock `at`."""
        self._check()
        self.observe(rank, at)
        return self.take_arrived(rank, src, tag)

    def read(self, rank: int, at: float, read: Callable[[Server], Any]) -> Any:
        """`read(server)` as of node `rank`'s clock `at`."""
        if self.server is None:
            raise RuntimeError("read_server: the run has no server (declare one with exogym.comm.serve)")
        self.observe(rank, at)
        return read(self.server)

    def cut(self, group: tuple[int, ...], count: int) -> None:
        """A checkpoint's pause: every node has met in its `count`-th collective on `group`; before the state is
        read, every message the other processes posted before it is in (their statuses follow their posts)."""
        if self.hub is not None:
            self.hub.wait_for(lambda s: s.started.get(group, 0) >= count)

    # ---- nodes ---------------------------------------------------------------------------------
    def _deliver(self, message: Message) -> None:
        if message.dst == SERVER:
            self._handle(message)
            return
        self._mail[message.dst].append(message)  # arrival order: the heap's order
        want = self._wants.get(message.dst)
        if want is not None and _matches(message, want[0], want[1]):
            del self._wants[message.dst]
            if self.hub is not None and self.hub.is_remote(message.dst):
                self.hub.answer(message.dst, self._first(message.dst, want[0], want[1]))
            else:
                self.baton.wake_receiver(message.dst)

    def _first(self, rank: int, src: int | None, tag: int | None) -> Message | None:
        box = self._mail[rank]
        for i, m in enumerate(box):
            if _matches(m, src, tag):
                return box.pop(i)
        return None

    def take(self, rank: int, src: int | None, tag: int | None, what: Callable[[], str]) -> Message:
        """The first message for `rank` from `src` with `tag` that has arrived; waits for one if none has (the
        node must have observed at its clock first)."""
        while True:
            m = self._first(rank, src, tag)
            if m is not None:
                return m
            self._wants[rank] = (src, tag, what())
            self.baton.await_message(rank, self._wants[rank][2])

    def wants(self) -> dict[int, tuple[int | None, int | None, str]]:
        return dict(self._wants)

    def take_arrived(self, rank: int, src: int | None, tag: int | None) -> list[Message]:
        """Every message for `rank` from `src` with `tag` that has arrived (the node observed at its clock first)."""
        box = self._mail[rank]
        taken = [m for m in box if _matches(m, src, tag)]
        self._mail[rank] = [m for m in box if not _matches(m, src, tag)]
        return taken

    def describe_waiting(self) -> list[str]:
        local = self.baton.describe_waiting()
        return ([local] if local else []) + ([] if self.hub is None else self.hub.describe_waiting())

    # ---- the server ----------------------------------------------------------------------------
    def serve(self, make: Callable[[], Server]) -> Server:
        self._check()
        if self.server is None:
            self.server = attach_server(make, self)
            self.active = True
            if self._saved_server is not None:  # a checkpoint read before the server was made
                self._load_server(self._saved_server)
                self._saved_server = None
        return self.server

    def wake_server(self, at: float) -> None:
        heapq.heappush(self._events, (at, _ARRIVE, SERVER, -1, next(self._order), (_WAKE, at)))

    def _handle(self, message: Message) -> None:
        if self.server is None:
            raise MessageError(f"{message.describe()}: the run has no server (a strategy declares one with "
                               "exogym.comm.serve in its setup)")
        self.server.stats.bytes_received += message.nbytes
        self._run_server(f"{message.describe()} (message {self.handled + 1} it handled)", message.arrives_at,
                         lambda s: s.receive(message))
        self.handled += 1

    def _run_server(self, what: str, at: float, call: Callable[[Server], None]) -> None:
        server = self.server
        server.now = at
        self.handling = (type(server).__name__, what)  # a handler that never returns is named by the watchdog
        try:
            with torch.no_grad():
                call(server)
        except Exception as e:
            raise MessageError(f"the server ({type(server).__name__}) raised while handling {what}: "
                               f"{type(e).__name__}: {e}") from e
        finally:
            self.handling = None


    # ---- checkpoints: the state at a pause (every node waits in the checkpoint's collective) -----------
    def state_dict(self) -> dict[str, Any]:
        """Messages in flight, mailboxes, the senders' counts and the server: plain data and tensors."""
        events = []
        for at, kind, rank, seq, order, item in self._events:
            if kind == _OBSERVE:
                raise RuntimeError(f"node {item} waits to observe at a checkpoint: the checkpoint was not taken "
                                   "while every node waited in its collective")
            events.append({"wake": item[1], "order": order} if isinstance(item, tuple)
                          else {"message": _plain(item), "order": order})
        server = self.server
        return {"events": events, "order": next(self._order) - 1, "sent": dict(self._sent), "handled": self.handled,
                "mail": {r: [_plain(m) for m in box] for r, box in self._mail.items()},
                "server": None if server is None else {
                    "state": server.state_dict(), "now": server.now, "updates": [dict(u) for u in server.updates],
                    "stats": {"bytes_sent": server.stats.bytes_sent, "bytes_received": server.stats.bytes_received,
                              "payload_bytes": server.stats.payload_bytes}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned; once (the backend reads it before any node runs, when it can: node 0's
        own call at its start then does nothing). A server not yet made takes its state when it is made.

        Args:
            state: What state_dict returned.

        Raises:
            RuntimeError: the state holds a server's and the run has a server of none (once it is made).
        """
        if self._loaded:
            return
        self._loaded = True
        self._events = []
        for e in state["events"]:
            if "wake" in e:
                self._events.append((e["wake"], _ARRIVE, SERVER, -1, e["order"], (_WAKE, e["wake"])))
            else:
                m = _message(e["message"])
                self._events.append((m.arrives_at, _ARRIVE, m.src, m.seq, e["order"], m))
        heapq.heapify(self._events)
        self._order = itertools.count(state["order"] + 1)
        self._sent, self.handled = dict(state["sent"]), state["handled"]
        self._mail = {int(r): [_message(m) for m in box] for r, box in state["mail"].items()}
        self.active = True
        if state["server"] is not None:
            if self.server is None:
                self._saved_server = state["server"]
                return
            self._load_server(state["server"])

    def check_loaded(self) -> None:
        """After node 0's start: a checkpoint's server state found its server.

        Raises:
            RuntimeError: the checkpoint holds a server's state but the run's strategy declared none.
        """
        if self._saved_server is not None:
            raise RuntimeError("the checkpoint holds a server's state but this run's strategy declares none")

    def _load_server(self, saved: dict[str, Any]) -> None:
        server = self.server
        server.load_state_dict(saved["state"])
        server.now, server.updates[:] = saved["now"], [dict(u) for u in saved["updates"]]
        server.stats.bytes_sent = saved["stats"]["bytes_sent"]
        server.stats.bytes_received = saved["stats"]["bytes_received"]
        server.stats.payload_bytes = saved["stats"]["payload_bytes"]


def arrival(network: Any, message: Message) -> float:
    """When a message sent at message.sent_at arrives: after the network's transfer time (none without a network).
    Worked out in the sender's process, by the same arithmetic everywhere."""
    seconds = 0.0 if network is None else network.message_seconds(message.nbytes, message.src, message.dst)
    return message.sent_at + seconds


def _plain(m: Message) -> dict[str, Any]:
    return {"src": m.src, "dst": m.dst, "tensor": m.tensor, "tag": m.tag, "meta": dict(m.meta), "sent_at": m.sent_at,
            "arrives_at": m.arrives_at, "seq": m.seq}


def _message(d: dict[str, Any]) -> Message:
    return Message(d["src"], d["dst"], d["tensor"], d["tag"], dict(d["meta"]), d["sent_at"], d["arrives_at"], d["seq"])


def _matches(m: Message, src: int | None, tag: int | None) -> bool:
    return (src is None or m.src == src) and (tag is None or m.tag == tag)


class SimSendWork:
    """isend's handle: wait() brings the sender's clock to the message's arrival (the transfer is communication)."""

    def __init__(self, clock: Any, message: Message):
        self._clock, self._message, self._done = clock, message, False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._done = True
            extra = self._message.arrives_at - self._clock.now
            if extra > 0:
                self._clock.comm_s += extra
                self._clock.now = self._message.arrives_at
        return True


class SimRecvWork:
    """irecv's handle: wait() takes the message (in arrival order) and returns it."""

    def __init__(self, transport: Any, src: int | None, tag: int | None, into: torch.Tensor | None):
        self._t, self._src, self._tag, self._into = transport, src, tag, into
        self._message: Message | None = None

    def is_completed(self) -> bool:
        return self._message is not None

    def wait(self, timeout: Any = None) -> Message:
        if self._message is not None:
            return self._message
        t, post = self._t, self._t.baton.post
        who = "any node" if self._src is None else "the server" if self._src == SERVER else f"node {self._src}"
        m = post.receive(t.rank, t.clock.now, self._src, self._tag, lambda: (
            f"recv from {who}" + ("" if self._tag is None else f" with tag {self._tag}")
            + f" at step {t.step}, since {t.clock.now:.6g} s"))
        if m.arrives_at > t.clock.now:  # waited for it: idle
            t.clock.wait_s += m.arrives_at - t.clock.now
            t.clock.now = m.arrives_at
        t.stats.bytes_received += m.nbytes
        if self._into is not None:
            self._into.copy_(m.tensor)
        self._message = m
        return m
