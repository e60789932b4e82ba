"""The post office of a process of a sim run that does not hold the keeper: it forwards its nodes' messages and
observations to the keeper (the process holding the server, beside node 0, exogym.backends.sim.postlink) and runs a node
again when the keeper answers. Nodes compute here in parallel with the other processes; everything they read goes
through the keeper's one event queue, in simulated-time order, as in one process.

The lookahead (exogym.backends.sim.postlink): the proxy tells the keeper its floor, the least clock of its nodes that may
run without the keeper, at each step of a node while it rises, as it takes answers in and when it runs out of work, so
the keeper takes events while the nodes here compute. To keep its floor rising, at the start of each step a node hands
over to a ready node with a lower clock (the order nodes take turns changes no bit), and to the scheduler when packets
wait, which takes them in between turns: an answered node then runs within a step, not after the others' rounds.

The server runs with the keeper; `serve` here returns a shadow of it (made by the same factory), which `read_server`
loads with the server's state as the keeper answers it at the node's turn (the server's `state_dict()`, its clock, its
update rows and byte counts) before handing it to the reader. So a read gives what it gives in one process; the
shadow's attributes are only as fresh as the last read of a node of this process, and the shadow never handles a
message or sends one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Mapping

from exogym.backends.sim.postlink import Ask, Link, Status
from exogym.backends.sim.events import arrival, poster
from exogym.backends.server_state import ShadowPost, check_readable, load_server
from exogym.comm.messages import Message, Server, attach_server

if TYPE_CHECKING:
    from exogym.backends.sim.events import CollectiveTransfer
    from exogym.backends.sim.baton import Baton
    from exogym.backends.sim.exchange import Exchange
    from exogym.backends.sim.transport import SimTransport
    from exogym.cluster.simtime import TimeModel

__all__ = ["PostProxy"]


class PostProxy:
    """The messages of this process's nodes, by way of the keeper in process `keeper` (same calls as PostOffice)."""

    def __init__(self, baton: "Baton", num_nodes: int, time_model: "TimeModel | None", exchange: "Exchange", keeper: int):
        self.baton, self.num_nodes, self.keeper_process, self.exchange = baton, num_nodes, keeper, exchange
        self.network = time_model.network if time_model is not None else None
        self.server: Server | None = None  # the server's shadow here, once a node declared it (it runs with the keeper)
        self._rows: list[dict[str, float]] = []  # the server's update rows as far as an answer showed them
        self.active = False  # a message was posted or a server declared: checkpoints pause the clocks
        self.progress = 0  # answers taken in (the deadlock check across processes)
        self._answers: dict[int, Any] = {}  # rank -> what the keeper answered it, until it runs
        # shared links: the messages posted whose arrival the keeper has not told yet, by number, and who waits on one
        self._shared = self.network is not None and self.network.shared_links
        self._on_wire: dict[int, Message] = {}
        self._token_of: dict[int, int] = {}  # id(message) -> its number, while on the wire
        self._sending: dict[int, int] = {}
        self._arrows: dict[int, tuple[list[float], int]] = {}  # the timeline's arrivals to fill in, by number
        self._posted = 0
        self._awaiting: set[int] = set()
        self._transfers: dict[tuple, "CollectiveTransfer"] = {}  # collectives' transfers at the keeper, by name
        self._reported: Status | None = None
        # the lookahead: the nodes' transports (their clocks), the time each was last answered at (it runs on from
        # then), and the floor last told with the answers taken in then
        self._nodes: Mapping[int, "SimTransport"] = {}
        self._answered_at: dict[int, float] = {}
        self._told: tuple[float, int] | None = None
        self._least: tuple[int, int | None, float] | None = None  # the last count: (answers taken in, its node, floor)
        self._bye = False
        self.link = Link(exchange, [keeper], self._on_packet)
        self._server_home = f"the process holding node 0 (process {keeper})"  # for the shadow's errors

    # ---- the baton's questions ------------------------------------------------------------------
    def busy(self) -> bool:
        # (a collective's transfer at the keeper: its async members may wait on it later)
        return bool(self._awaiting or self._transfers)

    def due(self) -> bool:
        return False  # the keeper's queue decides

    def watch(self, nodes: Mapping[int, "SimTransport"]) -> None:
        """This process's nodes (rank -> transport): their clocks make the floor, and each step calls `on_step`."""
        self._nodes = nodes
        for transport in nodes.values():
            transport.on_step = self.on_step

    def _resumes_at(self, rank: int) -> float:
        """The least clock node `rank` causes anything at from now on (running or ready)."""
        return max(self._nodes[rank].clock.now, self._answered_at.get(rank, -math.inf))

    def floor(self, running: int | None = None) -> float:
        """The least clock at which a node here can cause an event without the keeper (inf: none can; -inf before the
        nodes are watched). `running`: the node starting a step. The nodes are counted again only when it is the one
        the last count found least, or that one finished, or an answer came in since (which may run a node from an
        earlier time): clocks only rise, and a node that went to wait on the keeper since can only raise the floor, so
        a floor not counted again is never above the true one (a step costs no pass over every node here)."""
        least = self._least
        if least is None or running is None or least[0] != self.progress or least[1] == running \
                or least[1] is not None and self.baton.is_finished(least[1]):
            floor, at = (math.inf if self._nodes else -math.inf), None
            for rank in self._nodes:
                if rank not in self._awaiting and not self.baton.is_finished(rank):
                    resumes = self._resumes_at(rank)
                    if resumes < floor:
                        floor, at = resumes, rank
            least = self._least = (self.progress, at, floor)
        # a collective across processes not completed here: its transfer (shared links) may start at its last arrival,
        # which an async member's clock has run past
        return min(least[2], self.baton.least_arrival_across())

    def report_floor(self, running: int | None = None) -> None:
        """Tell the keeper the floor and the answers taken in, when either changed (after the packets sent before).
        `running`: the node starting a step, if one is."""
        told = (self.floor(running), self.progress)
        if told != self._told:
            self._told = told
            self.link.send(self.keeper_process, "floor", *told)

    def on_step(self, rank: int) -> None:
        """Node `rank` starts a step (it runs): hand over while packets wait to be taken in or a ready node has a
        lower clock, then tell the floor."""
        while self.exchange.has_news() or self._lower_ready(rank):
            self.baton.wake(rank)  # queued at its clock, behind the lower ones
            self.baton.sleep(rank)
        self.report_floor(rank)

    def _lower_ready(self, rank: int) -> bool:
        """Whether a node that may run comes before `rank` in the run queue (at a lower clock)."""
        queue = self.baton.queue
        return queue.has_runs() and self._nodes[queue.first_run()].clock.now < self._nodes[rank].clock.now

    @property
    def shares_collectives(self) -> bool:
        """Whether a collective's transfer runs as a flow (shared links): the keeper's."""
        return self._shared

    def transfer(self, transfer: "CollectiveTransfer") -> None:
        """A collective's transfer as a flow of the keeper's: posted there by one process holding a member
        (exogym.backends.sim.events.poster); its blocking members here wait on the keeper (out of the floor) until it
        tells the flow's end ("ended"), when they leave as in one process."""
        self._transfers[transfer.name] = transfer
        self._awaiting.update(transfer.waiting)
        self._least = None  # the floor is counted again (it may rise)
        if poster(transfer.holders, self.keeper_process) == self.exchange.me:
            self.link.send(self.keeper_process, "collective", transfer.name, transfer.start, transfer.route,
                           transfer.first, transfer.holders)

    def report_idle(self) -> None:
        """Nothing to run here: tell the keeper, once per change (after every packet sent before, in order)."""
        self.report_floor()
        status = Status(self.progress, dict(self.baton.crossings_started), frozenset(self.baton.open_crossings))
        if status != self._reported:
            self._reported = status
            self.link.send(self.keeper_process, "status", status)

    def finish(self) -> None:
        """Every node here is done: the last status, then the keeper's goodbye (no receive is left posted)."""
        self.link.send(self.keeper_process, "status", Status(self.progress, dict(self.baton.crossings_started),
                                                          frozenset(), finished=True))
        while not self._bye:
            self.exchange.wait(timeout=0.25)
            self.exchange.check_peers()
        self.link.join()

    def packets(self) -> tuple[dict[int, int], dict[int, int]]:
        """The link's packets sent to the keeper and taken in from it."""
        return self.link.counts()

    def _on_packet(self, src: int, packet: tuple) -> None:
        if packet[0] == "bye":
            self._bye = True
            return
        if packet[0] == "ended":  # a collective's transfer ended at the keeper: its members leave
            _, name, flow = packet
            self.progress += 1
            transfer = self._transfers.pop(name)
            for rank in transfer.waiting:
                self._answered_at[rank] = flow.arrival
                self._awaiting.discard(rank)
            transfer.leave(flow)
            transfer.done()
            return
        if packet[0] == "arrived":  # a message's flow ended at the keeper: its arrival time
            _, token, at = packet
            self.progress += 1
            message = self._on_wire.pop(token)
            del self._token_of[id(message)]
            message.arrives_at = at
            arrow = self._arrows.pop(token, None)
            if arrow is not None:
                arrow[0][arrow[1]] = at
            rank = self._sending.pop(token, None)
            if rank is not None:
                self._answered_at[rank] = at
                self._awaiting.discard(rank)
                self.baton.wake_receiver(rank)
            return
        _, rank, payload, at = packet  # "answer"
        self.progress += 1
        self._answers[rank] = payload
        self._answered_at[rank] = at
        self._awaiting.discard(rank)
        self.baton.wake_receiver(rank)

    # ---- what the nodes' transports call ------------------------------------------------------------
    def post(self, message: Message) -> None:
        self.active = True
        if not self._shared:
            message.arrives_at = arrival(self.network, message)
            self.link.send(self.keeper_process, "post", message)
            return
        self._posted += 1  # shared links: the keeper runs its flow and tells its arrival under this number
        self._on_wire[self._posted] = message
        self._token_of[id(message)] = self._posted
        self.link.send(self.keeper_process, "post", message, self._posted)

    def arrow(self, message: Message, arrives: list[float], index: int) -> None:
        """The timeline logs `message` at `arrives[index]`: with shared links, its arrival is put there when the keeper
        tells it (a process whose nodes have all finished is told no more: those arrows are left out)."""
        token = self._token_of.get(id(message))
        if token is not None:
            self._arrows[token] = (arrives, index)

    def log_arrivals(self, rank: int, arrives: list[float]) -> None:
        """Nothing: the keeper does not tell this process the arrivals of its messages on the wire at the checkpoint
        (their arrows are left out of the timeline)."""

    def sent(self, rank: int, message: Message) -> None:
        """Node `rank` waits on its send: with shared links, until the keeper tells its arrival."""
        token = self._token_of.get(id(message))
        if token is None:
            return
        self._sending[token] = rank
        self._awaiting.add(rank)
        self._least = None  # the floor is counted again (it may rise)
        self.baton.await_message(rank, f"its send of {message.nbytes} bytes, on the wire (told by the keeper)")

    def link_usage(self) -> None:
        """The keeper keeps the links' use (node 0's log)."""
        return None

    def link_spans(self) -> None:
        """The keeper keeps the links' spans (node 0's log)."""
        return None

    def _ask(self, rank: int, at: float, op: str, src: int | None, tag: int | None, what: str, known: int = 0) -> Any:
        self.baton.arrivals += 1  # progress, for the watchdog
        self.link.send(self.keeper_process, "ask", Ask(rank, at, op, src, tag, what, known))
        self._awaiting.add(rank)
        self._least = None  # the floor is counted again (it may rise)
        self.baton.await_message(rank, what)
        return self._answers.pop(rank)

    def receive(self, rank: int, at: float, src: int | None, tag: int | None, what: Callable[[], str]) -> Message:
        return self._ask(rank, at, "recv", src, tag, what())

    def arrived(self, rank: int, at: float, src: int | None, tag: int | None) -> list[Message]:
        return self._ask(rank, at, "poll", src, tag, f"poll at {at:.6g} s")

    def read(self, rank: int, at: float, read: Callable[[Server], Any]) -> Any:
        """`read(server)` as of node `rank`'s clock `at`: the keeper's server state at the node's turn, in the shadow.

        Raises:
            RuntimeError: the run has no server, or its class does not define state_dict and load_state_dict (what a
                read here loads).
        """
        if self.server is None:
            raise RuntimeError("read_server: the run has no server (declare one with exogym.comm.serve)")
        check_readable(self.server, rank, self._server_home)
        known = len(self._rows)
        state = self._ask(rank, at, "read", None, None, f"read_server at {at:.6g} s", known)
        if state is None:
            raise RuntimeError(f"read_server: the run has no server in the process holding node 0 (process "
                               f"{self.keeper_process}); every node declares it with exogym.comm.serve in its setup")
        # The rows only grow: keep the longest prefix any answer showed, and hand this reader the rows it was shown
        # (another node's answer may have been taken in since this one was asked, with more rows or fewer).
        count = known + len(state["updates"])
        self._rows.extend(state["updates"][len(self._rows) - known:])
        load_server(self.server, {**state, "updates": self._rows[:count]})
        return read(self.server)

    def serve(self, make: Callable[[], Server]) -> Server:
        """The server's shadow here (made by `make()` at the first call): read_server loads the server's state
        into it."""
        self.active = True
        if self.server is None:
            self.server = attach_server(make, ShadowPost(self.num_nodes, self._server_home))
        return self.server

    def cut(self, group: tuple[int, ...], count: int) -> None:
        """A checkpoint's pause: the keeper takes in this process's messages (node 0 keeps the state)."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("the messages' state is kept by node 0, with the keeper")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing: the keeper reads the messages' state."""

    def check_loaded(self) -> None:
        """Nothing: the keeper reads the messages' state."""
