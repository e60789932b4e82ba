"""What the sim's scheduler (exogym.backends.sim.baton) and the nodes' transports ask of a process's messages, as one
declared interface: the post office where the run's event queue lives (exogym.backends.sim.postoffice, one process
or the keeper) and a proxy forwarding to it (exogym.backends.sim.postproxy) both give it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

from exogym.comm.messages import Message, Server

if TYPE_CHECKING:
    from exogym.backends.sim.events import CollectiveTransfer

__all__ = ["Messages", "Crossings", "QueueOwner", "Packets"]

Packets = tuple[dict[int, int], dict[int, int]]  # the message link's packets: (sent to each process, taken in from each)


class Crossings(Protocol):
    """What the scheduler asks of the collectives whose members live in several processes
    (exogym.backends.sim.exchange.Exchange)."""

    completed: int  # crossings done (progress, for the deadlock check)

    @property
    def busy(self) -> bool:
        """Whether some crossing is on its way."""

    def start(self, pending: Any, calls: list[Any], op: str, finish: Callable[[list[Any], float], None]) -> None:
        """The last local member of `pending` (a baton.Pending) arrived: send this process's part."""

    def wait(self, timeout: float) -> list[Any]:
        """Wait up to `timeout` s for the other processes; run what they sent (the message link's packets)."""

    def check_peers(self) -> None:
        """Raise PeerLostError when a process this one may wait for stopped responding."""

    def report_stall(self, description: str, progress: int, packets: Packets | None = None) -> str | None:
        """This process has nothing to run; every process's description once the run is deadlocked, else None."""

    def report_running(self) -> None:
        """This process runs again."""

    def report_finished(self) -> None:
        """Every node of this process finished."""


class QueueOwner(Protocol):
    """What the keeper's end of the message link hands to the post office holding the run's event queue."""

    baton: Any  # the process's scheduler (exogym.backends.sim.baton.Baton): its nodes that may run, for the lookahead
    network: Any  # the run's Network (None: no time model): its least latency, for the lookahead
    progress: int  # events that happened

    @property
    def events(self) -> Any:
        """The run's event queue (exogym.backends.sim.events.EventQueue)."""

    def next_at(self) -> float | None:
        """The simulated time of the next event (None: none is waiting)."""

    def push(self, message: Message, token: tuple[int, int] | None = None) -> None:
        """A message another process posted: its arrival time set, or (shared links) `token`, (the process, its
        number there), under which the keeper tells the process its arrival once its flow ends."""

    def ask(self, ask: Any) -> None:
        """A node of another process observes at its clock (a postlink.Ask)."""

    def transfer(self, transfer: "CollectiveTransfer") -> None:
        """A collective's transfer another process posted, to run as a flow (its leave tells the holders its end)."""

    def wants(self) -> dict[int, tuple[int | None, int | None, str]]:
        """Rank -> (src, tag, what) of every node waiting in a recv."""


class Messages(Protocol):
    """A process's point-to-point messages and the run's server, on the simulated clock."""

    active: bool  # a message was posted or a server declared: checkpoints pause the clocks
    progress: int  # events that happened here (the deadlock check across processes)

    @property
    def server(self) -> Server | None:
        """The run's server (or its shadow in a process away from it), once a strategy declared one."""

    # ---- the scheduler's questions ----------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether the scheduler must go on for the messages (events to happen, answers to wait for)."""

    def due(self) -> bool:
        """Whether the next event may happen now (asked when no node of the process can run)."""

    def next_event(self) -> None:
        """Let the earliest event happen."""

    def report_idle(self) -> None:
        """The process has nothing to run (a proxy tells the keeper)."""

    def finish(self) -> None:
        """Every node of the process is done."""

    def packets(self) -> Packets | None:
        """The message link's packet counts (None: the run is one process's)."""

    # ---- what the nodes' transports call ----------------------------------------------------------------------
    @property
    def shares_collectives(self) -> bool:
        """Whether a collective's transfer runs as a flow on the shared links (`transfer`), not alone by its
        formula."""

    def transfer(self, transfer: "CollectiveTransfer") -> None:
        """A collective's transfer as a flow (over processes, the keeper's: posted there by one process holding
        members): its end sets the members' clocks (transfer.leave) and lets them run (transfer.done)."""

    def post(self, message: Message) -> None:
        """Put a message on the wire at message.sent_at."""

    def sent(self, rank: int, message: Message) -> None:
        """Node `rank` waits on its send until the message's arrival time is known (shared links: its flow ended)."""

    def arrow(self, message: Message, arrives: list[float], index: int) -> None:
        """The timeline logs `message`'s arrival at `arrives[index]`: filled in once known (shared links)."""

    def log_arrivals(self, rank: int, arrives: list[float]) -> None:
        """A resumed node's log of its messages' arrivals: those on the wire at the checkpoint are filled in there."""

    def link_usage(self) -> dict[str, dict[str, float]] | None:
        """Each link's busy seconds and bytes, kept up to date (the post office with shared links; else None)."""

    def link_spans(self) -> dict[str, dict[str, Any]] | None:
        """Each link's busy spans, kept up to date (the post office with shared links; else None)."""

    def receive(self, rank: int, at: float, src: int | None, tag: int | None, what: Callable[[], str]) -> Message:
        """Node `rank`'s next message from `src` with `tag`, observed at its clock `at`."""

    def arrived(self, rank: int, at: float, src: int | None, tag: int | None) -> list[Message]:
        """Every message for `rank` from `src` with `tag` that has arrived by its clock `at`."""

    def read(self, rank: int, at: float, read: Callable[[Server], Any]) -> Any:
        """`read(server)` as of node `rank`'s clock `at`."""

    def serve(self, make: Callable[[], Server]) -> Server:
        """The run's server (or its shadow), made by `make()` at the first call."""

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def cut(self, group: tuple[int, ...], count: int) -> None:
        """A checkpoint's pause: every message posted before it is in."""

    def state_dict(self) -> dict[str, Any]:
        """Messages in flight, mailboxes and the server, as plain data and tensors."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""

    def check_loaded(self) -> None:
        """After node 0's start: a checkpoint's server state found its server."""
