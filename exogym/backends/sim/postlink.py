"""The message channel of a sim run that spans processes: between the keeper (the process holding the server, beside
node 0: its post office keeps the run's one event queue, every node's mailbox and the server) and the other processes,
whose post offices are proxies (exogym.backends.sim.postproxy).

What goes over it, as pickled packets on torch.distributed point-to-point messages (gloo, tags of their own beside the
exchange's):
- a proxy to the keeper: `post` (a message a node sent, with its arrival time worked out where it was sent), `ask` (a
  node wants to observe at its clock: take a message, every message that has arrived, or the server's state for
  `read_server`), `floor` (the least clock at which a node of the process can still cause an event without the
  keeper, and how many answers it has taken in: the lookahead below), `collective` (shared links: a collective's
  transfer to run as a flow, posted by one process holding members, exogym.backends.sim.events.poster: its (group,
  sequence number), start, route, first rank and the processes holding members), `status` (the process has nothing to
  run: how many answers it has taken in, and which collectives across processes it has started and has open), and at
  its end a last status marked finished;
- the keeper to a proxy: `answer` (what a node asked for, and the simulated time it is answered at; it runs again),
  `arrived` (shared links: a message the proxy posted has its arrival time, once its flow ended; counted as an
  answer, since it may run a node waiting on its send), `ended` (shared links: a collective's transfer with members
  there ended, its flow, whose arrival is when they leave, TimeModel.leave_flow; counted as an answer, since it runs
  its blocking members) and `bye` (after its last status).

Why nothing arrives out of order: every packet of one process to the keeper goes on one (sender, receiver, tag) pair,
which torch.distributed delivers in the order sent, and the keeper handles a process's packets in that order. So when
the keeper holds a process's status, it holds every message that process posted and every question it asked before it
ran out of work. The keeper lets the next event happen when no node anywhere can still post an event that comes before
it (in one process: when no node is ready), by one of two rules.

The lookahead (`Keeper.ahead`, a conservative parallel discrete-event simulation in the manner of Chandy, Misra and
Bryant, with the floors as its null messages). A node causes events only at or after its clock, and clocks only move
forward: it sends at its clock (a message starts at its sent_at and arrives later), it observes at its clock, and a
collective returns it at or after its arrival. A node waiting on the keeper (in a recv, a poll, a read_server, on its
send's arrival under shared links, or in a collective whose transfer is the keeper's flow) causes nothing until the
keeper answers it, and it runs on from the time of that answer (the ask's time, the message's arrival, the flow's end)
or later. So each proxy tells its floor: the least clock of its nodes that may run without the keeper (ready, running,
in a collective, parked; not those waiting on the keeper, nor the finished), and the least arrival of its members in a
collective across processes not yet completed there (its transfer may start at the last arrival, which an async member's
clock has run past), infinity when there is none, with the count of answers it had taken in. The keeper's floor of
process p is the least of p's last floor and the time of every answer sent to p that p had not taken in when it told it
(`Keeper.floor_of`). The floor comes after the posts before it on the pair, so when the keeper holds it, every event p's
nodes caused before it is in the queue; every event they cause after it comes at or after the floor, or at or after an
answer counted in. Let `lowest` be the least of every other process's floor, every clock of the keeper's own nodes that
are ready, and the least arrival of its own members in a collective across processes not yet completed (they leave it at
or after the last arrival, when its transfer starts). The keeper, with no node parked, takes the next event, at time t,
when t < lowest. Less, strictly: a node at its floor may still start a flow or observe at that very time, and ties go by
rank. Then every event with a smaller key than this one is already in the queue: it was caused by a node of the keeper
(a ready one at or after its clock; those waiting run again only from later events), by the server (at the times of the
events it handles), or by another process's node before that process's last floor (in the queue) or after it (at or
after the floor, so after t). (A node of the keeper in a local collective leaves it at or after the last member's
arrival, and that member is ready, in a collective across processes, or waiting on a later event: on shared links, its
transfer's end.) So the event comes off the queue in the order one process takes it, while the other processes' nodes
compute. Proxies tell their floor at every step of a node while it rises (SimTransport's step hook), as they take in
answers, and when they run out of work. A node of the keeper, at each step (`Keeper.on_step`), hands over while packets
wait to be taken in (the scheduler takes them in between turns: without it a node ran its whole round before another
process's message or floor was seen), and to the next event when that event comes before its clock, or, when another
process has every node waiting on the keeper, when the latency lookahead below lets an event go ahead: so the nodes of
other processes waiting on it are answered while it computes, not after its round.

A collective's transfer on shared links (a strategy that sends messages: its collectives are the keeper's flows too)
starts at its last member's arrival s, a START event like a message's. Every process holding a member computes the same
route and start once the collective completes there (the exchange gives every holder the last arrival anywhere), and one
of them posts it (exogym.backends.sim.events.poster): the keeper when it holds a member (it starts the flow as it
completes the collective: its members were in `lowest` at their arrivals until then), else the lowest holder, whose
floor stays at or below s until it posts (its members count at their arrivals while the collective is open there; a
collective within the process completes as its last member arrives, running at s), and the post comes before its next
floor on the pair. So the START is in the queue before the keeper takes any event at or after s. From the completion on,
every holder's blocking members wait on the keeper (out of its floor); at the flow's end the keeper sends each holder
`ended`, an answer at the flow's arrival, the time they run on from, and each sets its members' clocks with
TimeModel.leave_flow from the same flow, as one process does.

The latency lookahead (`Keeper._promote`): an event that only a node waiting on the keeper sees (a message arriving for
a node waiting in recv, another process's node's recv or poll) may happen ahead of the events before it, when it
comes at time s < lowest + L, L being the network's least latency (no message from another sender reaches a node
sooner after it is sent, shared links or not). Every event not yet taken comes at or after `lowest` (the queue's
next one included), so every message the node has not yet received and that no event in the queue already carries
to it (an arrival, or its own message on the wire: to itself it takes no time; then it waits) arrives after s; the
node's mailbox sees its messages in the order one process gives them, and it reads at s what it reads there (a
collective's transfer ending lets its members run on from its end, at or after `lowest`: their messages arrive after
s too). The events skipped touch other state (the flows, the server, other mailboxes) and come later in the same order
among themselves; the node runs on from s, after every event it could have caused. The server's events are never taken
ahead: any node may read the server (read_server) at its clock.

Quiescence (`Keeper.quiet`), for what the floors do not decide: the keeper takes the next event when every process has
run out of work since the last answer it was sent, and no collective across processes has every holder started
and some holder still open (its members would run again without the keeper; on shared links they wait for its
transfer, which the holder posting it sends before its next status). Then no node anywhere can post an event
the keeper has not seen, as in one process, where the keeper takes the next event only when no node is ready. With
nothing left to happen, a node waiting for a message is then a deadlock.

Why `quiet` cannot be fooled by a stale status (a process reported, then woke up): a process wakes only on an answer
(counted: the keeper waits for the status taking it in) or on a collective across processes completing, which needs
every holder to have started it. If a holder's last status shows it open, the rule makes the keeper wait unless some
holder's status shows it not started; that holder then started it after its status, so it ran after its status, so
it was woken after its status, by an earlier completion or answer (`ended` is one): following the causes back in time
must end at a process that woke with nothing to wake it, which cannot be.

`read_server` is an observation like a `recv`: a node of another process asks (`ask`, op "read") at its clock and
waits, so its process cannot post anything that node would do next until the keeper answers; the keeper answers at the
ask's turn in the queue, when every earlier event has happened and the run is quiescent, with the server's state as it
stands then. So the reader sees what it sees in one process, and a read never lets the keeper run ahead of it.

Packets travel in batches: what queued up for a peer while the last batch was on its way goes as one transfer, in
order. Each side counts the packets it sent to each peer and those it took in from each (`Link.counts`); the deadlock
check across processes (exogym.backends.sim.exchange) declares a deadlock only when every process waits with
nothing to run, nothing changed for a second, and no packet is in flight (every count sent equals the receiver's
count taken in): a packet on its way is a question, an answer or a status that wakes its receiver or lets the keeper go
on, however slowly a loaded machine delivers it. (Without the counts, AsyncDiLoCo on 1,024 nodes over two processes
ended about 2 runs in 12 in a false deadlock while the keeper took in process 1's 512 read_server questions.)
"""

from __future__ import annotations

import math
import pickle
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
import torch.distributed as dist

from exogym.backends.sim.events import ARRIVE, FINISH, OBSERVE, START, CollectiveTransfer
from exogym.cluster.network import parse_seconds
from exogym.comm.messages import Message

if TYPE_CHECKING:
    from exogym.backends.sim.exchange import Exchange
    from exogym.backends.sim.protocols import QueueOwner
    from exogym.backends.sim.transport import SimTransport
    from exogym.cluster.flows import Flow
    from exogym.cluster.network import Route

__all__ = ["Link", "Keeper", "Status", "Ask"]

# gloo's tags are 32-bit; the exchange's stay below 2**30 (exogym.backends.sim.exchange._tag)
_HEADER_TAG, _BODY_TAG = (1 << 30) | 1, (1 << 30) | 2


@dataclass(frozen=True)
class Ask:
    """A node's observation, asked of the keeper: at its clock `at`, `op` "recv" (the first matching message, or wait for
    one), "poll" (every matching message that has arrived) or "read" (the server's state, its update rows from row
    `known` on: exogym.backends.sim.serverhost.server_state)."""

    rank: int
    at: float
    op: str
    src: int | None
    tag: int | None
    what: str  # for a deadlock's message: what the node waits for
    known: int = 0  # "read": the server's update rows the asking process already holds


@dataclass(frozen=True)
class Status:
    """A process with nothing to run: answers taken in, collectives across processes started (per group, how many)
    and open (started here, not yet completed here), and whether every node of the process has finished."""

    answers: int
    started: dict[tuple[int, ...], int] = field(default_factory=dict)
    open: frozenset[tuple] = frozenset()
    finished: bool = False


class Link:
    """Packets between this process and the others of the link (the keeper talks to every process, a proxy to the keeper).

    Each peer's packets are sent by a thread of their own, in the order `send` was called (the process's own thread
    never blocks on a peer that stopped), and received by another, in order, and handed to `on_packet(src, packet)`
    on the process's own thread at its next wait in the exchange (Exchange.notify). A peer that goes away is a
    PeerLostError naming it (exogym.backends.peer_watch), raised on the process's thread; one that stops is named by
    the heartbeats the process checks while it waits."""

    def __init__(self, exchange: "Exchange", peers: list[int], on_packet: Callable[[int, tuple], None]):
        self.exchange, self.on_packet = exchange, on_packet
        self._outbox: dict[int, queue.Queue] = {p: queue.Queue() for p in peers}
        # Packets sent to each peer and taken in from each (on the process's own thread): the deadlock check
        # across processes holds off while one is in flight (exogym.backends.sim.exchange.in_flight).
        self.sent, self.taken = {p: 0 for p in peers}, {p: 0 for p in peers}
        self._threads = [threading.Thread(target=self._receive, args=(p,), name=f"exogym-postlink-in-{p}", daemon=True)
                         for p in peers]
        self._senders = [threading.Thread(target=self._send, args=(p,), name=f"exogym-postlink-out-{p}", daemon=True)
                         for p in peers]
        for t in self._threads + self._senders:
            t.start()

    def send(self, dst: int, *packet: Any) -> None:
        """Queue a packet for `dst` (pickled now: what it holds may change once this returns)."""
        self.sent[dst] += 1
        self._outbox[dst].put(pickle.dumps(packet, protocol=pickle.HIGHEST_PROTOCOL))

    def counts(self) -> tuple[dict[int, int], dict[int, int]]:
        """(packets sent to each peer, packets taken in from each), as of now."""
        return dict(self.sent), dict(self.taken)

    def _take(self, src: int, packet: tuple) -> None:
        self.taken[src] += 1
        self.on_packet(src, packet)

    def _send(self, dst: int) -> None:
        # What queued up while the last batch was on its way goes as one transfer (a header, then the packets'
        # bytes), in order: 512 questions of one process's nodes cost one round of gloo sends, not 512.
        try:
            box, last = self._outbox[dst], False
            while not last:
                batch = [box.get()]
                while batch[-1] is not None and not box.empty():
                    batch.append(box.get_nowait())
                last = batch[-1] is None
                batch = [b for b in batch if b is not None]
                if not batch:
                    continue
                data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
                dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, tag=_HEADER_TAG)
                dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag=_BODY_TAG)
        except BaseException as e:  # noqa: BLE001 - raised on the process's own thread
            def lost(error: BaseException = e) -> None:
                raise self.exchange.peers.lost(dst, error) from error
            self.exchange.notify(lost)

    def _receive(self, src: int) -> None:
        try:
            while True:
                header = torch.empty(1, dtype=torch.int64)
                dist.recv(header, src, tag=_HEADER_TAG)
                body = torch.empty(int(header), dtype=torch.uint8)
                dist.recv(body, src, tag=_BODY_TAG)
                for data in pickle.loads(body.numpy().tobytes()):
                    packet = pickle.loads(data)
                    self.exchange.notify(lambda p=packet: self._take(src, p))
                    if packet[0] in ("bye", "status") and (packet[0] == "bye" or packet[1].finished):
                        return  # the peer's last packet
        except BaseException as e:  # noqa: BLE001 - raised on the process's own thread
            def lost(error: BaseException = e) -> None:
                raise self.exchange.peers.lost(src, error) from error
            self.exchange.notify(lost)

    def join(self, timeout: float = 5.0) -> None:
        """After the last packets: the senders send what is queued, then every thread ends."""
        for box in self._outbox.values():
            box.put(None)
        for t in self._senders + self._threads:
            t.join(timeout)


class Keeper:
    """The keeper's side of the link: the other processes' statuses and the answers sent to them, and whether the run
    is quiescent (module docstring). `post` is the keeper's post office (exogym.backends.sim.postoffice.PostOffice)."""

    def __init__(self, post: "QueueOwner", exchange: "Exchange", owner: list[int], me: int):
        self.post, self.owner, self.me = post, list(owner), me
        self.remotes = sorted(set(self.owner) - {me})
        self.status: dict[int, Status] = {}
        self.answered = {p: 0 for p in self.remotes}
        # the lookahead (module docstring): each process's last floor and answers taken in then, and the answers sent
        # since (their number and simulated time) that its floor does not count yet
        self.floors: dict[int, tuple[float, int]] = {}
        self._told: dict[int, deque[tuple[int, float]]] = {p: deque() for p in self.remotes}
        self.overlapped = 0  # events taken while some other process's node could run (the lookahead at work)
        self._nodes: Mapping[int, "SimTransport"] = {}  # this process's nodes (their clocks), once watched
        self.promoted = 0  # arrivals at waiting nodes taken ahead of their time (the latency lookahead)
        net = getattr(post, "network", None)  # no message into a node takes less than this (from another sender)
        self._latency = 0.0 if net is None else min(
            parse_seconds(net.latency), parse_seconds(net.server_latency if net.server_latency is not None
                                                      else net.latency, "server_latency"))
        self._holders: dict[tuple[int, ...], set[int]] = {}
        self.exchange = exchange
        self.link = Link(exchange, self.remotes, self._on_packet)

    def wait_for(self, ok: Callable[[Status], bool]) -> None:
        """Take in the other processes' packets until each one's last status satisfies `ok`."""
        while not all((s := self.status.get(p)) is not None and ok(s) for p in self.remotes):
            self.exchange.wait(timeout=0.25)
            self.exchange.check_peers()

    def is_remote(self, rank: int) -> bool:
        return rank >= 0 and self.owner[rank] != self.me

    def answer(self, rank: int, payload: Any, at: float) -> None:
        """What node `rank` (in another process) asked for, answered at simulated time `at` (the ask's time, or the
        arrival of the message it waited for): it runs again there, from `at` or later."""
        process = self.owner[rank]
        self._count_answer(process, at)
        self.link.send(process, "answer", rank, payload, at)

    def arrived(self, token: tuple[int, int], at: float) -> None:
        """Shared links: the message process `token[0]` posted as its `token[1]`-th arrives at `at`."""
        process, number = token
        if (s := self.status.get(process)) is not None and s.finished:
            return  # its nodes are done: none waits on the send, and after its goodbye nothing is received there
        self._count_answer(process, at)  # a sender waiting on it runs on from `at`
        self.link.send(process, "arrived", number, at)

    def ended(self, holders: tuple[int, ...], name: tuple, flow: "Flow") -> None:
        """Shared links: the transfer of collective `name` (its (group, sequence number)) ended; the processes
        `holders` hold members that leave at its end (`flow.arrival`: TimeModel.leave_flow's). Counted as an answer:
        its blocking members there run on from then."""
        for process in holders:
            if (s := self.status.get(process)) is not None and s.finished:
                continue  # its nodes are done: none waits on it
            self._count_answer(process, flow.arrival)
            self.link.send(process, "ended", name, flow)

    def _posted_transfer(self, name: tuple, start: float, route: "Route", first: int,
                         holders: tuple[int, ...]) -> CollectiveTransfer:
        """A collective's transfer another process posted (exogym.backends.sim.events.poster): its end is told to
        every process holding a member (none is here: the keeper posts its own)."""
        return CollectiveTransfer(start, route, lambda flow: self.ended(holders, name, flow), first,
                                  done=lambda: None, name=name)

    def _count_answer(self, process: int, at: float) -> None:
        self.answered[process] += 1
        self._told[process].append((self.answered[process], at))

    def floor_of(self, process: int) -> float:
        """The least simulated time at which a node of `process` can still cause an event the keeper has not seen
        (module docstring): -inf before its first floor, inf once it finished."""
        s = self.status.get(process)
        if s is not None and s.finished:
            return math.inf
        report = self.floors.get(process)
        if report is None:
            return -math.inf
        told = self._told[process]
        return min(report[0], min(at for _, at in told)) if told else report[0]

    def ahead(self, at: float, running: float = math.inf) -> bool:
        """Whether the next event, at simulated time `at`, may happen now by the lookahead (module docstring):
        before every other process's floor and every clock of this process's nodes that may run, of the node running
        (`running`), and the least arrival of those in a collective across processes not yet completed here (the
        baton's open crossings); or an event only a waiting node sees, made the next one (`_promote`)."""
        baton = self.post.baton
        if baton.parked:
            return False  # they compute once nothing else runs: quiescence decides
        remote = min((self.floor_of(p) for p in self.remotes), default=math.inf)
        queue = baton.queue
        runs = self._clock(queue.first_run()) if queue.has_runs() else math.inf  # the runs are in clock order
        # a member of a collective across processes leaves it at or after its arrival, and on shared links its
        # transfer starts at or after it (an async member's clock has run on: its arrival, not its clock)
        lowest = min(remote, running, runs, baton.least_arrival_across())
        if at < lowest:
            if remote < math.inf and running == math.inf:  # counted once, when it happens
                self.overlapped += 1
            return True
        return self._latency > 0 and lowest > -math.inf and self._promote(lowest + self._latency)

    def _promote(self, horizon: float) -> bool:
        """The latency lookahead (module docstring): the earliest event that only a node waiting on the keeper sees (a
        message arriving for a node waiting in recv; another process's node's recv or poll), if it comes before
        `horizon`, is made the next one (Returns: whether one was)."""
        waiting = self.post.wants()
        best = None
        for entry in self.post.events.entries():
            if entry[0] >= horizon or best is not None and entry >= best:
                continue
            kind, item = entry[1], entry[5]
            if kind == ARRIVE and isinstance(item, Message) and item.dst in waiting or \
                    kind == OBSERVE and isinstance(item, Ask) and item.op != "read":
                best = entry
        if best is None:
            return False
        rank = best[5].dst if best[1] == ARRIVE else best[5].rank
        if any(e < best and self._reaches(e, rank) for e in self.post.events.entries()):
            return False  # a message for it arrives first, or may (its own, on the wire: no latency to itself)
        self.post.events.promote(best)
        self.promoted += 1
        return True

    @staticmethod
    def _reaches(entry: tuple, rank: int) -> bool:
        """Whether event `entry` is a message arriving for node `rank`, or one of its own messages on the wire (START,
        FINISH: one it sent itself arrives without latency; a collective's transfer carries no message)."""
        kind, item = entry[1], entry[5]
        if kind == ARRIVE:
            return isinstance(item, Message) and item.dst == rank
        if kind == START:
            return not isinstance(item, CollectiveTransfer) and item.src == rank
        return kind == FINISH and item[0][0] == rank

    def watch(self, nodes: Mapping[int, "SimTransport"]) -> None:
        """This process's nodes (rank -> transport): each step calls `on_step`."""
        self._nodes = nodes
        for transport in nodes.values():
            transport.on_step = self.on_step

    def _clock(self, rank: int) -> float:
        node = self._nodes.get(rank)
        return -math.inf if node is None else node.clock.now

    def on_step(self, rank: int) -> None:
        """Node `rank` of this process starts a step: it hands over while packets wait to be taken in (the other
        processes' messages, questions and floors), to a node that may run from a lower clock, and to the next event
        while that may happen before it (the lookahead), so that the other processes' nodes waiting on the keeper are
        answered while it computes, not after its round."""
        baton = self.post.baton
        queue = baton.queue
        while True:
            mine = self._clock(rank)
            news = self.exchange.has_news()
            if not news and not (queue.has_runs() and self._clock(queue.first_run()) < mine):
                at = self.post.next_at()
                # an event after its clock goes first only by the latency lookahead, and only to feed a process
                # whose nodes all wait on the keeper (else it would cost a scan of the queue each step for nothing)
                if at is None or at >= mine and not self._starved() or \
                        not self.ahead(at, running=mine):
                    return
            happened, turns = self.post.progress, baton.all_turns
            baton.wake(rank)  # its run, at its clock: the scheduler takes the packets in and what comes before it
            baton.sleep(rank)
            if not news and self.post.progress == happened and baton.all_turns == turns + 1:
                return  # nothing went before it after all

    def _starved(self) -> bool:
        """Whether another process has every unfinished node waiting on the keeper, with no answer on its way: an event
        taken ahead (`_promote`) then lets it compute while this one does."""
        for p in self.remotes:
            s = self.status.get(p)
            if (s is None or not s.finished) and self.floor_of(p) == math.inf:
                return True
        return False

    def unfinished(self) -> bool:
        return any(not (s := self.status.get(p)) or not s.finished for p in self.remotes)

    def _on_packet(self, src: int, packet: tuple) -> None:
        kind = packet[0]
        if kind == "post":
            self.post.push(packet[1], (src, packet[2]) if len(packet) > 2 else None)
        elif kind == "collective":  # (name, start, route, first rank, holders): a transfer to run as a flow
            self.post.transfer(self._posted_transfer(*packet[1:]))
        elif kind == "ask":
            self.post.ask(packet[1])
        elif kind == "floor":  # (floor, answers taken in): the answers counted in leave the ones still told
            _, floor, taken = packet
            self.floors[src] = (floor, taken)
            told = self._told[src]
            while told and told[0][0] <= taken:
                told.popleft()
        elif kind == "status":
            self.status[src] = packet[1]
            if packet[1].finished:
                self.link.send(src, "bye")
        else:
            raise RuntimeError(f"unknown packet {kind!r} from process {src}")

    def quiet(self, started: dict, open_here: set) -> bool:
        """Whether the run is quiescent, this process having nothing to run (`started`, `open_here`: its crossings)."""
        views = {self.me: (started, open_here)}
        for p in self.remotes:
            s = self.status.get(p)
            if s is None or not s.finished and s.answers != self.answered[p]:
                return False  # still running, or not yet past an answer
            views[p] = (s.started, s.open)
        for _, open_ in views.values():
            for group, seq in open_:
                if all(views[h][0].get(group, 0) > seq for h in self._holders_of(group)):
                    return False  # every holder started it: it completes without the keeper, and its members run
        return True

    def _holders_of(self, group: tuple[int, ...]) -> set[int]:
        h = self._holders.get(group)
        if h is None:
            h = self._holders[group] = {self.owner[r] for r in group}
        return h

    def describe_waiting(self) -> list[str]:
        return [f"  node {r}: waits in {what}" for r, (_, _, what) in sorted(self.post.wants().items())
                if self.is_remote(r)]

    def close(self) -> None:
        self.link.join()
