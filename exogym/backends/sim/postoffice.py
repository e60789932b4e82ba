"""The sim backend's point-to-point messages and the transfers on shared links: what each event of the run's one
queue does, and what the nodes' transports call.

The run's one event queue (exogym.backends.sim.events) holds, in simulated-time order, the nodes that may run and
the events: transfers starting and ending, messages arriving, the server's timers, the nodes' observations. The
scheduler (exogym.backends.sim.baton) takes its entries in order; the post office says what an event does, and holds
the nodes' mailboxes (exogym.backends.sim.mailboxes) and the server (exogym.backends.sim.serverhost). A node that
observes at its clock t (a `recv`, an `irecv`'s wait, a `poll` or a `read_server`) first lets every run and event
before t (and every message arriving at t) happen.

The invariant: whatever a node or the server reads (a message taken, the server's state) depends on simulated
time only. A node computes alone between observations, and its computation can reach another node only
through a message, which arrives at its own time and waits in the queue until every earlier entry has been taken:
a node that may run from clock c comes before every event after c (it may still send at c or later, never before),
and every observation goes back through the queue. A two-node interleaving that would break it without the queue:
node 1 (clock 9) sends at 9 and arrives at 10 while node 0 (clock 2, not yet run) would send at 2 and arrive at 3;
the server handling node 1's message first would apply the updates out of order. In the queue, node 0's run at 2
comes before the arrival at 10, and node 0's message arrives first.

On a network with shared links (exogym.cluster.flows) a message is a flow: it starts at its sent_at (a START
event, in time order like the rest, so no flow starts before one already started), shares its links with the
flows in flight, and arrives its route's latency after its last byte leaves (a FINISH event: one in the queue, for
the flow whose last byte leaves first; a flow starting or ending makes it stale and pushes the next one). A sender
waiting on its send (`send`, an `isend`'s wait) sleeps until its message's FINISH, when its arrival time is known.
A collective's transfer is a flow too (`transfer`): it starts at its last member's arrival, and its members wait
until its FINISH, when their clocks are set (`shares_collectives`: in one process; over several, for a strategy that
sends messages, whose collectives' transfers the keeper runs beside the messages).

Ties are broken by fixed keys (rank, then the sender's count), so the same seed gives the same bits however
the host schedules. A node blocked in a collective has no entry; the messages it sends after leaving carry its
clock from then on.

A run over several processes (fit(processes=P), torchrun with backend="sim"): the process holding the server role
(beside node 0) keeps the queue's events, every mailbox and the server (it is the keeper); the other processes' post
offices are proxies (exogym.backends.sim.postproxy) that send it their nodes' messages and observations and run a node
again when it answers; a collective's transfer comes to the keeper as a message does (posted by one process holding
members), and its end goes to every process holding members. The keeper takes the next event when no node of any process
can still cause an earlier one (the lookahead: every other process tells its nodes' least clock as they compute), or
else once its own nodes have run and the whole run is quiescent, which is the rule above with "no node may run" read
across every process; exogym.backends.sim.postlink says why the exchange between the processes cannot deliver a message
out of order, so the run gives the bits one process gives.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

from exogym.backends.sim.mailboxes import Mailboxes
from exogym.backends.sim.events import FINISH, OBSERVE, START, CollectiveTransfer, EventQueue, Timer, arrival, \
    message_from_plain, message_plain
from exogym.backends.sim.postlink import Ask
from exogym.backends.sim.serverhost import ServerHost, server_state
from exogym.cluster.flows import Flow, FlowModel
from exogym.cluster.network import SERVER
from exogym.comm.messages import Message, Server
from exogym.comm.transport import MessageError

if TYPE_CHECKING:
    from exogym.backends.sim.baton import Baton
    from exogym.backends.sim.postlink import Keeper
    from exogym.cluster.simtime import TimeModel

__all__ = ["PostOffice"]


class PostOffice:
    """The messages in flight, the nodes' mailboxes and the run's server, for the nodes under one baton."""

    def __init__(self, baton: "Baton", num_nodes: int, time_model: "TimeModel | None"):
        self.baton, self.num_nodes = baton, num_nodes
        self.network = time_model.network if time_model is not None else None
        self.keeper: "Keeper | None" = None  # the other processes' nodes, when the run spans processes (set by the backend)
        self.undeclared = False  # the run spans processes without a keeper: a message is an error (set by the backend)
        self.progress = 0  # events that happened (the deadlock check across processes)
        self.active = False  # a message was posted or a server declared: checkpoints pause the clocks
        self.links_cut: dict[str, Any] | None = None  # a collectives-only run's state at its last checkpoint's cut
        self._loaded = False  # a checkpoint's state is in (read before any node ran)
        self._events = baton.queue  # the run's one queue: the nodes' runs are in it too
        self._boxes = Mailboxes(num_nodes)
        self._host = ServerHost()
        # shared links: the messages' flows, the messages on the wire by (src, seq), the senders waiting on one, and
        # which were posted by another process (process, its token: told their arrival when their flow ends)
        shared = self.network is not None and self.network.shared_links
        self._flows: FlowModel | None = FlowModel() if shared else None
        self._wire: dict[tuple[int, int], Message] = {}
        self._linkless: dict[tuple[int, int], bool] = {}  # (src, dst) -> its messages cross no finite link
        self._collectives: dict[tuple, CollectiveTransfer] = {}  # the collectives' transfers on the wire, by flow key
        self._sending: dict[tuple[int, int], int] = {}
        self._posted_by: dict[tuple[int, int], tuple[int, int]] = {}
        self._arrows: dict[tuple[int, int], tuple[list[float], int]] = {}  # the timeline's arrivals to fill in
        # a resumed run's: the arrows of the messages on the wire at the checkpoint (by (src, seq): the index in their
        # sender's log), and the resumed nodes' logs they point into (log_arrivals)
        self._saved_arrows: dict[tuple[int, int], int] = {}
        self._logs: dict[int, list[float]] = {}

    @property
    def server(self) -> Server | None:
        """The run's server, once a strategy declared one."""
        return self._host.server

    @property
    def events(self) -> EventQueue:
        """The run's event queue (the keeper's lookahead reads it, exogym.backends.sim.postlink)."""
        return self._events

    @property
    def handling(self) -> tuple[str, str] | None:
        """(the server's class, what it handles) while a handler runs: the watchdog reads it from its thread."""
        return self._host.handling

    # ---- the baton's questions --------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether the baton must go on for the messages: events to happen, or (the keeper) other processes running."""
        return self._events.has_events() or self.keeper is not None and self.keeper.unfinished()

    def due(self) -> bool:
        """Whether the next event may happen now (the baton asks when no node's run comes before it). In one process:
        whenever there is one. The keeper: when no node of any process can still cause an earlier one (the lookahead),
        or once its own nodes have run and the whole run is quiescent (exogym.backends.sim.postlink); then, with
        nothing left to happen, a node waiting for a message is a deadlock.

        Raises:
            MessageError: the run is quiescent, nothing is in flight, and some node waits in a recv.
        """
        if self.keeper is None:
            return self._events.has_events()
        # the lookahead: it happens while other processes' nodes run if none of them can cause an earlier event
        if self._events.has_events() and self.keeper.ahead(self._events.next_at()):
            return True
        if self._events.has_runs() or not self.keeper.quiet(self.baton.crossings_started, set(self.baton.open_crossings)):
            return False
        if self._events.has_events():
            return True
        if self._boxes.wants():
            raise MessageError("deadlock: no message will ever arrive for the nodes waiting in recv (every other node "
                               "is finished or waits itself, and nothing is in flight):\n"
                               + "\n".join(self.describe_waiting()))
        return False

    def next_at(self) -> float | None:
        """The simulated time of the next event (None: none is waiting)."""
        return self._events.next_at() if self._events.has_events() else None

    def report_idle(self) -> None:
        """The baton has nothing to run (a proxy reports it to the keeper; nothing to do here)."""

    def finish(self) -> None:
        """The baton's nodes are done: the keeper waits for the link's threads."""
        if self.keeper is not None:
            self.keeper.close()

    def packets(self) -> tuple[dict[int, int], dict[int, int]] | None:
        """The link's packets sent and taken in, per process (None: the run is one process's)."""
        return None if self.keeper is None else self.keeper.link.counts()

    def next_event(self) -> None:
        """Let the earliest event happen (the keeper calls it when no node is ready)."""
        kind, item = self._events.pop()
        self.progress += 1
        if kind == FINISH:
            self._finish(*item)
        elif kind == START:
            if isinstance(item, CollectiveTransfer):
                self._start_collective(item)
            else:
                self._start(item)
        elif kind == OBSERVE:
            if isinstance(item, Ask):
                self._answer(item)
            else:
                self.baton.wake(item)
        elif isinstance(item, Timer):
            self._host.run(lambda: f"its timer at {item.at:.6g} s", item.at, lambda s: s.wake(item.at))
        elif item.dst == SERVER:
            self._host.handle(item)
        else:
            self._deliver(item)

    # ---- messages in -------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.undeclared:
            raise MessageError("this run spans processes and its strategy sends point-to-point messages (or declares a "
                               "server) without saying so: set the class attribute sends_messages = True on the "
                               "strategy, so that the process holding node 0 keeps the run's one event queue")

    def post(self, message: Message) -> None:
        """Put a message on the wire at message.sent_at; it arrives after the network's transfer time (shared links:
        once its flow ends; its arrives_at is nan until then)."""
        self._check()
        if self._flows is None or self._crosses_no_link(message.src, message.dst):
            # (every link on its route is infinite: it is alone whatever else is in flight, and arrives as the
            # formula says; no flow, and its sender needs not wait to know when)
            message.arrives_at = arrival(self.network, message)
            self.active = True
            self._events.arrive(message)
        else:
            self.push(message)
        if message.src == SERVER and self.server is not None:  # its sent_log logs it next (exogym.comm.messages)
            arrives = self.server.sent_log.messages["arrives"]
            self.arrow(message, arrives, len(arrives))

    def arrow(self, message: Message, arrives: list[float], index: int) -> None:
        """The timeline logs `message` at `arrives[index]`: with shared links, its arrival is put there when its flow
        ends (until then the log holds nan)."""
        if math.isnan(message.arrives_at):
            self._arrows[(message.src, message.seq)] = (arrives, index)

    def _crosses_no_link(self, src: int, dst: int) -> bool:
        """Whether a message from `src` to `dst` crosses no finite link (the route's links do not depend on bytes)."""
        key = (src, dst)
        none = self._linkless.get(key)
        if none is None:
            none = self._linkless[key] = not self.network.message_route(0, src, dst).links
        return none

    def push(self, message: Message, token: tuple[int, int] | None = None) -> None:
        """A message on the wire (its arrival time set by the sender's process, without shared links): into the
        queue, numbered as its sender's next. `token`: (process, its number there) of a message another process
        posted, told its arrival when its flow ends."""
        self.active = True
        if self._flows is None:
            self._events.arrive(message)
            return
        message.arrives_at = math.nan
        self._events.start(message)
        if token is not None:
            self._posted_by[(message.src, message.seq)] = token

    def sent(self, rank: int, message: Message) -> None:
        """Node `rank` waits on its send: with shared links, until its flow ends and its arrival time is known."""
        if not math.isnan(message.arrives_at):
            return
        self._sending[(message.src, message.seq)] = rank
        self.baton.await_message(rank, f"its send of {message.nbytes} bytes to "
                                       f"{'the server' if message.dst == SERVER else f'node {message.dst}'}, on the wire")

    def link_usage(self) -> dict[str, dict[str, float]] | None:
        """Each link's busy seconds and bytes (live: complete once every flow has ended), or None without shared
        links."""
        return None if self._flows is None else self._flows.links

    def link_spans(self) -> dict[str, dict[str, Any]] | None:
        """Each link's busy spans (exogym.cluster.flows.FlowModel.spans; live: complete once every flow has ended),
        or None without shared links."""
        return None if self._flows is None else self._flows.spans

    def _start(self, message: Message) -> None:
        key = (message.src, message.seq)
        self._wire[key] = message
        self._flows.start(key, self.network.message_route(message.nbytes, message.src, message.dst), message.sent_at)
        self._schedule()

    @property
    def shares_collectives(self) -> bool:
        """Whether a collective's transfer runs as a flow on the shared links, rather than alone by its formula: with
        shared links, in one process, and over processes for a strategy that sends messages (the keeper runs them;
        without messages there is no keeper, and exogym.backends.sim.alone checks the collectives were alone)."""
        return self._flows is not None and not self.undeclared

    def transfer(self, transfer: CollectiveTransfer) -> None:
        """A collective's transfer (shares_collectives): its flow starts at transfer.start, in time order with the
        rest; when it ends, transfer.leave sets its members' clocks and transfer.done lets them run. The keeper also
        runs the transfers other processes post (exogym.backends.sim.postlink), and tells the other processes holding
        members of its own crossings when they end."""
        others = () if self.keeper is None else tuple(h for h in transfer.holders if h != self.keeper.me)
        if others:  # a collective across processes, this one posting it: the others' members leave at its end too
            leave, keeper, name = transfer.leave, self.keeper, transfer.name

            def leave_everywhere(flow: Flow) -> None:
                leave(flow)
                keeper.ended(others, name, flow)
            transfer.leave = leave_everywhere
        transfer.key = ("collective", transfer.first, transfer.name)
        self._events.start_collective(transfer.start, transfer.key, transfer)

    def _start_collective(self, transfer: CollectiveTransfer) -> None:
        self._collectives[transfer.key] = transfer
        self._flows.start(transfer.key, transfer.route, transfer.start)
        self._schedule()

    def _schedule(self) -> None:
        """The FINISH event of the flow whose last byte leaves first, as the flows stand now."""
        flow = self._flows.next_finish()
        if flow is not None:
            self._events.finish(flow.finish, flow.key, self._flows.version)

    def _finish(self, key: tuple, version: int) -> None:
        if version != self._flows.version:
            return  # a flow started or ended since: the FINISH event pushed then is the one
        flow = self._flows.finish(key)
        if key[0] == "collective":
            transfer = self._collectives.pop(key)
            transfer.leave(flow)
            self._schedule()
            transfer.done()
            return
        message = self._wire.pop(key)
        message.arrives_at = flow.arrival
        self._events.arrive(message, numbered=True)
        self._schedule()
        arrow = self._arrows.pop(key, None)
        if arrow is None and key in self._saved_arrows:  # on the wire at the checkpoint this run resumed from
            arrow = (self._log_of(key[0]), self._saved_arrows.pop(key))
        if arrow is not None and arrow[0] is not None:
            arrow[0][arrow[1]] = message.arrives_at
        rank = self._sending.pop(key, None)
        if rank is not None:
            self.baton.wake_receiver(rank)
        token = self._posted_by.pop(key, None)
        if token is not None:
            self.keeper.arrived(token, message.arrives_at)

    def log_arrivals(self, rank: int, arrives: list[float]) -> None:
        """A resumed node's timeline log of its messages' arrivals: those on the wire at the checkpoint are filled
        in there when their flows end (shared links).

        Args:
            rank: The node.
            arrives: Its log's arrivals column (exogym.cluster.spans.SpanLog), restored from the checkpoint.
        """
        self._logs[rank] = arrives

    def _log_of(self, src: int) -> list[float] | None:
        if src == SERVER:
            return self.server.sent_log.messages["arrives"] if self.server is not None else None
        return self._logs.get(src)

    def wake_server(self, at: float) -> None:
        """A server timer (Server.wake_at)."""
        self._events.timer(at)

    def _deliver(self, message: Message) -> None:
        want = self._boxes.deliver(message)
        if want is None:
            return
        if self.keeper is not None and self.keeper.is_remote(message.dst):
            self.keeper.answer(message.dst, self._boxes.first(message.dst, want[0], want[1]), message.arrives_at)
        else:
            self.baton.wake_receiver(message.dst)

    # ---- observations -----------------------------------------------------------------------------
    def observe(self, rank: int, at: float) -> None:
        """Node `rank` is about to read something at its clock `at`: every earlier event happens first."""
        self.baton.arrivals += 1  # progress, for the watchdog
        if self.keeper is None and not self.baton.parked and not self._events.before(at, rank):
            return  # no run and no event comes before it: it reads now, without a switch
        self._events.observe(at, rank, rank)
        self.baton.sleep(rank)

    def ask(self, ask: Ask) -> None:
        """A node of another process observes at its clock (the keeper): its turn comes in simulated-time order, as a
        node's here."""
        self._events.observe(ask.at, ask.rank, ask)

    def _answer(self, ask: Ask) -> None:
        if ask.op == "read":  # the server's state now, at the node's turn, as a node here would read it
            self.keeper.answer(ask.rank, None if self.server is None else server_state(self.server, since=ask.known),
                            ask.at)
            return
        if ask.op == "poll":
            self.keeper.answer(ask.rank, self._boxes.take_arrived(ask.rank, ask.src, ask.tag), ask.at)
            return
        m = self._boxes.first(ask.rank, ask.src, ask.tag)
        if m is not None:
            self.keeper.answer(ask.rank, m, ask.at)
        else:
            self._boxes.wait(ask.rank, ask.src, ask.tag, ask.what)

    # ---- what the nodes' transports call ----------------------------------------------------------------
    def receive(self, rank: int, at: float, src: int | None, tag: int | None, what: Callable[[], str]) -> Message:
        """Node `rank`'s next message from `src` with `tag`, observed at its clock `at`: the first that has arrived,
        or the next to arrive."""
        self._check()
        self.observe(rank, at)
        while True:
            m = self._boxes.first(rank, src, tag)
            if m is not None:
                return m
            self._boxes.wait(rank, src, tag, what())
            self.baton.await_message(rank, self._boxes.wants()[rank][2])

    def arrived(self, rank: int, at: float, src: int | None, tag: int | None) -> list[Message]:
        """Every message for `rank` from `src` with `tag` that has arrived by its clock `at`."""
        self._check()
        self.observe(rank, at)
        return self._boxes.take_arrived(rank, src, tag)

    def read(self, rank: int, at: float, read: Callable[[Server], Any]) -> Any:
        """`read(server)` as of node `rank`'s clock `at`."""
        if self.server is None:
            raise RuntimeError("read_server: the run has no server (declare one with exogym.comm.serve)")
        self.observe(rank, at)
        return read(self.server)

    def serve(self, make: Callable[[], Server]) -> Server:
        """The run's server, made by `make()` at the first call."""
        self._check()
        if self.server is None:
            self.active = True
        return self._host.serve(make, self)

    def wants(self) -> dict[int, tuple[int | None, int | None, str]]:
        """Rank -> (src, tag, what) of every node waiting in a recv, in any process."""
        return self._boxes.wants()

    def describe_waiting(self) -> list[str]:
        local = self.baton.describe_waiting()
        return ([local] if local else []) + ([] if self.keeper is None else self.keeper.describe_waiting())

    # ---- checkpoints: the state at a pause (every node waits in the checkpoint's collective) -----------
    def cut(self, group: tuple[int, ...], count: int) -> None:
        """A checkpoint's pause: every node has met in its `count`-th collective on `group`; before the state is
        read, every message the other processes posted before it is in (their statuses follow their posts)."""
        if self.keeper is not None:
            self.keeper.wait_for(lambda s: s.started.get(group, 0) >= count)

    def state_dict(self) -> dict[str, Any]:
        """Messages in flight, mailboxes, the senders' counts and the server: plain data and tensors (a collective's
        transfer on the wire is not saved: a node with an async collective not yet waited on refuses the checkpoint
        first, SimTransport._refuse_unwaited)."""
        if self._collectives:
            raise RuntimeError(f"collective transfers are on the wire at a checkpoint ({sorted(self._collectives)}): "
                               "the checkpoint was not taken while every node waited in its collective")
        state = {**self._events.state_dict(), "handled": self._host.handled, "mail": self._boxes.state_dict(),
                 "server": self._host.state_dict(), "active": self.active}
        if self._flows is not None:
            arrows = {**self._saved_arrows, **{key: index for key, (_, index) in self._arrows.items()}}
            state["flows"] = {**self._flows.state_dict(), "wire": [message_plain(m) for m in self._wire.values()],
                              "arrows": [[src, seq, index] for (src, seq), index in arrows.items()]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned; once (the backend reads it before any node runs, when it can: node 0's
        own call at its start then does nothing). A server not yet made takes its state when it is made.

        Args:
            state: What state_dict returned.
        """
        if self._loaded:
            return
        self._loaded = True
        self._events.load_state_dict(state)
        if self._flows is not None and "flows" in state:
            self._flows.load_state_dict(state["flows"])
            self._wire = {(m.src, m.seq): m for m in map(message_from_plain, state["flows"]["wire"])}
            self._saved_arrows = {(src, seq): index for src, seq, index in state["flows"].get("arrows", ())}
        self._host.handled = state["handled"]
        self._boxes.load_state_dict(state["mail"])
        self.active = state.get("active", True)  # False: only the links' use of collectives was kept
        self._host.load_state_dict(state["server"])

    def check_loaded(self) -> None:
        """After node 0's start: a checkpoint's server state found its server.

        Raises:
            RuntimeError: the checkpoint holds a server's state but the run's strategy declared none.
        """
        self._host.check_loaded()
