"""The comm layer's core: groups, reduce ops, byte formulas, and which node is calling.

Strategies call the module-level functions in `exogym.comm.collectives`; those look up
the calling node's `Transport` here (bound per thread by the backend), count the bytes
that node sends, and hand the call to the backend. A strategy never sees the backend.

Words: a *transport* is one node's endpoint of a backend (SimTransport, TorchTransport: how bytes
move); a *communication module* (DiLoCoCommunicator, SparseCommunicator, ...) is an algorithm deciding
what to send. The original ExoGym names the modules "Communicator", so the transports are named apart.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from exogym.cluster.membership import Membership
    from exogym.cluster.simtime import NodeClock

__all__ = ["CollectiveError", "MessageError", "Group", "ReduceOp", "Transport", "TransportBase", "CommStats",
           "current_transport", "bind_transport"]


class CollectiveError(RuntimeError):
    """Nodes used collectives in a way that would hang or corrupt a real cluster (names the nodes and calls)."""


class MessageError(CollectiveError):
    """A point-to-point message that can never be delivered or taken (a recv no send will match, a server that
    raised): names the nodes, the message and the simulated time."""


class ReduceOp(str, enum.Enum):
    """How a reduction combines the members' tensors: SUM, AVG, MAX, MIN or PRODUCT."""
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"

    @classmethod
    def of(cls, op: object) -> "ReduceOp":
        """Accept our enum, its string value, or `torch.distributed.ReduceOp` (strategies from the original use it).

        Args:
            op: The op in any of those forms.

        Returns:
            The ReduceOp.

        Raises:
            ValueError: An unsupported op (listing the supported ones).
        """
        if isinstance(op, cls):
            return op
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if isinstance(name, str):
            try:
                return cls(name.lower())
            except ValueError:
                pass
        raise ValueError(f"unsupported reduce op {op!r}; use one of {[o.value for o in cls]} "
                         "or torch.distributed.ReduceOp.SUM/AVG/MAX/MIN/PRODUCT")


@dataclass(frozen=True)
class Group:
    """An ordered set of node ranks taking part in a collective (the world, an island, a pair).

    Args:
        ranks: The members' global ranks.
    """

    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self.ranks


def make_group(ranks: Sequence[int], num_nodes: int) -> Group:
    ranks = tuple(int(r) for r in ranks)
    if not ranks:
        raise ValueError("a group needs at least one rank, got an empty list")
    bad = [r for r in ranks if not 0 <= r < num_nodes]
    if bad:
        raise ValueError(f"group ranks must lie in 0..{num_nodes - 1} (num_nodes={num_nodes}), got {bad}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"group ranks must be distinct, got {list(ranks)}")
    return Group(tuple(sorted(ranks)))


# Bytes each member sends, for the bandwidth-optimal (ring / pipelined chain) algorithm of each op.
# N is the payload in bytes, R the group size. These are what NCCL and gloo move for large tensors.

def all_reduce_bytes(nbytes: int, group_size: int) -> int:
    """Ring all-reduce = reduce-scatter + all-gather: each member sends 2 N (R-1)/R."""
    return 2 * nbytes * (group_size - 1) // group_size


def reduce_scatter_bytes(input_nbytes: int, group_size: int) -> int:
    """Ring reduce-scatter of an N-byte input: each member sends N (R-1)/R."""
    return input_nbytes * (group_size - 1) // group_size


def all_gather_bytes(chunk_nbytes: int, group_size: int) -> int:
    """Ring all-gather: each member's n-byte chunk travels R-1 hops, so each sends n (R-1)."""
    return chunk_nbytes * (group_size - 1)


def broadcast_bytes(nbytes: int, group: Group, src: int, rank: int) -> int:
    """Pipelined chain from src around the group: every member but the chain's last sends N."""
    pos = (group.ranks.index(rank) - group.ranks.index(src)) % group.size
    return nbytes if pos < group.size - 1 else 0


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def payload_nbytes(op: str, tensor: torch.Tensor | None, group_size: int,
                   input_list: Sequence[torch.Tensor] = ()) -> int:
    """N in the network model's formulas: the full tensor (all-reduce, broadcast), the gathered output
    (all-gather), the full input (reduce-scatter)."""
    if op == "all_gather":
        return tensor_nbytes(tensor) * group_size
    if op == "reduce_scatter":
        return sum(map(tensor_nbytes, input_list))
    return tensor_nbytes(tensor) if tensor is not None else 0


# Payload bytes: what a node puts on the wire once, its own data counted one time however many hops it takes
# (the papers' convention: DeMo's "110 MB per node per step" is one node's indices and values). The wire bytes
# above are what the ring algorithm makes the node send in total (an all-gathered chunk goes R-1 hops).

def payload_bytes(op: str, nbytes: int, group: Group, src: int | None = None, rank: int | None = None) -> int:
    """A node's own bytes that leave it: all-reduce and all-gather its whole tensor (N, or its chunk n);
    reduce-scatter the (R-1)/R of its input meant for the others; broadcast N from the source only; nothing
    in a group of one."""
    if group.size < 2:
        return 0
    if op == "reduce_scatter":
        return nbytes * (group.size - 1) // group.size
    if op == "broadcast":
        return nbytes if rank == src else 0
    return nbytes if op in ("all_reduce", "all_gather") else 0


@dataclass
class CommStats:
    """What one node has sent so far: total wire bytes (bytes_sent), bytes and calls per op, and payload bytes
    (its own data counted once; see payload_bytes)."""

    bytes_sent: int = 0
    bytes_by_op: dict[str, int] = field(default_factory=dict)
    calls_by_op: dict[str, int] = field(default_factory=dict)
    payload_bytes: int = 0  # a class default too, so stats pickled before it existed read 0
    bytes_received: int = 0  # point-to-point messages taken in (the node's download; collectives count sends only)

    def add(self, op: str, nbytes: int, payload: int = 0) -> None:
        self.bytes_sent += nbytes
        self.payload_bytes += payload
        self.bytes_by_op[op] = self.bytes_by_op.get(op, 0) + nbytes
        self.calls_by_op[op] = self.calls_by_op.get(op, 0) + 1


class Work(Protocol):
    """The handle an async collective returns: wait() blocks until its results are in the tensors."""

    def wait(self) -> bool: ...
    def is_completed(self) -> bool: ...


class Transport(Protocol):
    """One node's view of a backend. Arguments arrive validated and normalised; no byte counting here.

    account=True (the strategy-facing calls in exogym.comm.collectives) advances the members'
    virtual clocks when the run has a time model; the trainer's own measurements (global-model
    averaging, diagnostics, checkpoint barriers) pass False and cost no simulated time.
    """

    rank: int
    num_nodes: int
    stats: CommStats
    world: Group
    clock: "NodeClock"
    step: int | None

    # async_op=True returns a handle with wait() (torch.distributed's Work); otherwise None.
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Group, *, account: bool = False,
                   async_op: bool = False) -> "Work | None": ...
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, account: bool = False,
                  async_op: bool = False) -> "Work | None": ...
    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group, *,
                   account: bool = False, async_op: bool = False) -> "Work | None": ...
    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp,
                       group: Group, *, account: bool = False, async_op: bool = False) -> "Work | None": ...
    def barrier(self, group: Group, *, account: bool = False, async_op: bool = False) -> "Work | None": ...
    def new_group(self, ranks: Sequence[int]) -> Group: ...
    def up(self, step: int | None = None) -> tuple[int, ...]: ...


class TransportBase:
    """What every backend's node endpoint keeps: its byte counts, virtual clock, current step, and the run's
    failure / elastic schedule, from which it answers who is up."""

    def __init__(self, rank: int, num_nodes: int, membership: "Membership | None" = None):
        from exogym.cluster.simtime import NodeClock
        self.rank, self.num_nodes, self.membership = rank, num_nodes, membership
        self.stats = CommStats()
        self.clock = NodeClock()
        self.world = Group(tuple(range(num_nodes)))
        self.step: int | None = None  # the node's current step (from 1), for membership and error messages

    def up(self, step: int | None = None) -> tuple[int, ...]:
        """The ranks up at `step` (default: the node's current step): every rank (the world's own tuple),
        unless the run has a failure or elastic schedule."""
        step = self.step if step is None else step
        if self.membership is None or step is None:
            return self.world.ranks
        return self.membership.alive(step)

    # Point-to-point messages and the server (exogym.comm.messages); a backend without them says so.
    def send_message(self, message: Any, *, blocking: bool) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")

    def receive_message(self, src: int | None, tag: int | None, into: torch.Tensor | None, *, blocking: bool) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")

    def poll_messages(self, src: int | None, tag: int | None) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")

    def serve(self, make: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot run a server")

    def read_server(self, read: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} cannot run a server")

    def close_messages(self) -> None:
        """After the node's last step and its global model: a backend with real messages winds them down."""

    def pause_for_checkpoint(self) -> None:
        """Before a checkpoint is saved: a backend whose nodes exchange messages aligns their clocks. Nothing by
        default."""

    def messages_state(self) -> dict[str, Any] | None:
        """What of the messages (in flight, the server) the checkpoint keeps, on the node that keeps it."""
        return None

    def link_usage(self) -> dict[str, dict[str, float]] | None:
        """Each shared link's busy seconds and bytes, on a backend that shares links (the sim); None elsewhere."""
        return None

    def link_spans(self) -> dict[str, dict[str, Any]] | None:
        """Each shared link's busy spans (the timeline's link lanes), where `link_usage` is given; None elsewhere."""
        return None

    def load_messages_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot restore messages in flight")

    def now(self) -> float:
        """The node's clock: simulated seconds (sim backend), or seconds since the run started."""
        return self.clock.now

    def restore(self, stats: CommStats, clock: "NodeClock") -> None:
        """A resumed node continues its byte counts and its virtual clock."""
        self.stats, self.clock = stats, clock


# A context variable, not a thread-local: sim nodes are greenlets of one thread, each with its own context.
_bound: contextvars.ContextVar[Transport | None] = contextvars.ContextVar("exogym_transport", default=None)


@contextlib.contextmanager
def bind_transport(comm: Transport) -> Iterator[Transport]:
    """Make `comm` the transport of the running node (a sim greenlet, or a torch process's main thread)."""
    token = _bound.set(comm)
    try:
        yield comm
    finally:
        _bound.reset(token)


def bound_transport() -> Transport | None:
    """The running node's transport, or None outside a running node."""
    return _bound.get()


def current_transport() -> Transport:
    comm = _bound.get()
    if comm is None:
        raise RuntimeError(
            "exogym.comm.collectives was called outside a running node; collectives work inside "
            "Strategy.step() (or anything it calls) while Trainer.fit is running"
        )
    return comm
