"""Point-to-point messages and the server: `send`, `recv`, `isend`, `irecv`, as in torch.distributed, and a
`Server` a strategy declares (global state, and the code that reacts to each message it receives).

What a message is: one tensor (copied when it is sent, so the sender may change its own at once), a `tag`
(an int, as in torch.distributed) and `meta`, a small dict of int/float values (a model version, a step
count; 8 bytes each on the wire). It goes from a node to another node or to the server (`dst=SERVER`).

When it arrives (the sim backend, where the simulated clock decides): a message leaves at the sender's clock
and arrives after the network model's transfer time (latency + bytes / the slowest of the link, the sender's
upload and the receiver's download; exogym.cluster.network.Network.message_seconds). A receiver takes the
messages meant for it in order of arrival, ties broken by the sender's rank (the server's, -1, first), then by
the order they were sent; the server handles each message at its arrival time, in that same order. Every
observation (a `recv`, `read_server`) happens in simulated-time order across the nodes, so what any node or
the server reads depends on simulated time only, never on how the host scheduled the nodes.

Blocking and clocks: `send` blocks until the message has arrived (the transfer is communication time on the
sender's clock); `isend` returns at once, and its handle's `wait()` brings the clock to the arrival.
`recv` returns the first matching message that has arrived by the node's clock, or waits for the next one
(the wait is idle time). A `recv` that no message will ever match (every node that could send is finished or
waits itself) raises a `MessageError` naming the nodes and what each waits for; so does a server that raises,
naming the message it was handling.

Bytes: a message counts its tensor and meta bytes as sent by the sender (under op "send") and as received by
the receiver (`bytes_received`); the server's own counts are in the record.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import torch

from exogym.cluster.network import SERVER
from exogym.cluster.spans import SpanLog
from exogym.comm import transport as _comm
from exogym.comm.transport import MessageError

__all__ = ["SERVER", "Message", "MessageError", "Server", "send", "isend", "recv", "irecv", "poll", "serve",
           "read_server", "now"]

_META_BYTES = 8  # one int or float of a message's meta


@dataclass
class Message:
    """One message: who sent it to whom, its tensor, tag and meta, and when it left and arrived.

    Times are seconds on the simulated clock; on the torch backend, seconds since the run started.

    Args:
        src: The sender: a node's rank, or SERVER.
        dst: The receiver: a node's rank, or SERVER.
        tensor: The tensor sent.
        tag: An int the receiver may select on.
        meta: A few int/float values sent with it.
        sent_at: When it left.
        arrives_at: When it arrived.
        seq: The sender's count of messages sent, from 0.
    """

    src: int
    dst: int
    tensor: torch.Tensor
    tag: int = 0
    meta: dict[str, float] = field(default_factory=dict)
    sent_at: float = 0.0
    arrives_at: float = 0.0
    seq: int = 0  # the sender's count of messages sent, from 0

    @functools.cached_property
    def nbytes(self) -> int:
        """The bytes sent: the tensor's and 8 per meta value (counted once: a message is not changed once made)."""
        return _comm.tensor_nbytes(self.tensor) + _META_BYTES * len(self.meta)

    def describe(self) -> str:
        """The message in words, for error messages: number, sender, receiver, tag, tensor, times.

        Returns:
            The description.
        """
        who = lambda r: "the server" if r == SERVER else f"node {r}"  # noqa: E731
        return (f"message #{self.seq} from {who(self.src)} to {who(self.dst)} (tag {self.tag}, tensor "
                f"{tuple(self.tensor.shape)} {str(self.tensor.dtype).replace('torch.', '')}, sent at "
                f"{self.sent_at:.6g} s, arriving at {self.arrives_at:.6g} s)")


class ServerPost(Protocol):
    """What a server's `send` and timers go through: the backend's delivery where the server runs, or a shadow's
    refusal away from it (for backends)."""

    num_nodes: int

    def post(self, message: Message) -> None:
        """Put the server's message on the wire at message.sent_at."""

    def wake_server(self, at: float) -> None:
        """Call the server's `wake(at)` at simulated time `at`."""


class Server:
    """A strategy's server: the run's global state and the code reacting to each message it receives.

    Subclass it and implement `receive(message)`; reply with `self.send(dst, tensor, tag=..., meta=...)`. A run
    has at most one server; on the sim backend it runs in the process of node 0 (over several processes, that
    process keeps the run's event queue), between the nodes' turns, at each message's arrival time (`self.now`); on
    the torch backend, on a thread of rank 0's process. Record each update it applies with
    `self.record_update(node=..., staleness=..., weight=...)` (a row of `trainer.record.updates`, with the
    simulated time added). For `read_server` away from the server (the sim's other processes, the torch backend's
    ranks other than 0), `state_dict()` must hold every attribute a node reads (their copy of the server is loaded
    from it).
    """

    rank = SERVER

    def __init__(self) -> None:
        self.now = 0.0  # the arrival time of the message being handled
        self.updates: list[dict[str, float]] = []
        self.stats = _comm.CommStats()
        self.sent_log = SpanLog()  # the messages it sent (exogym.cluster.spans), for the run's timeline
        self._post: "ServerPost | None" = None  # the backend's way out, bound by serve()

    def receive(self, message: Message) -> None:
        """React to one message (in arrival order). Raise to stop the run (the error names the message).

        Args:
            message: The Message that arrived.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement receive(message)")

    def send(self, dst: int, tensor: torch.Tensor, *, tag: int = 0, meta: Mapping[str, float] | None = None) -> None:
        """Send `tensor` to node `dst`; it leaves now (the current message's arrival time).

        Args:
            dst: The node's rank.
            tensor: What to send (copied now).
            tag: An int the receiver may select on.
            meta: A few int/float values sent with it.
        """
        message = Message(SERVER, _check_dst(dst, self._post.num_nodes, SERVER), tensor.detach().clone(), int(tag),
                          _check_meta(meta), sent_at=self.now)
        self.stats.add("send", message.nbytes, message.nbytes)
        self._post.post(message)
        self.sent_log.sent(message.dst, message.sent_at, message.arrives_at, message.nbytes)  # the timeline's arrows

    def wake_at(self, at: float) -> None:
        """Have `wake(at)` called at simulated time `at` (no earlier than now), in order with the arrivals.

        A timer: a grace window that closes with no message arriving.

        Args:
            at: The simulated time.
        """
        if not at >= self.now:
            raise ValueError(f"wake_at({at!r}) is before the server's clock {self.now!r}")
        self._post.wake_server(at)

    def wake(self, at: float) -> None:
        """Called at the time a `wake_at` asked for (`self.now` is it). Nothing by default.

        Args:
            at: The time asked for.
        """

    def record_update(self, **row: float) -> None:
        """One applied update, for `trainer.record.updates`: node, staleness, weight, and whatever else applies.

        Args:
            **row: The update's columns (the simulated time is added).
        """
        self.updates.append({"sim_time_s": self.now, **row})

    def snapshot(self) -> dict[str, Any]:
        """What `read_server` hands a node by default: override to expose the global state."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """The server's state for a checkpoint (tensors and plain data). Override with the global state."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict()` returned.

        Args:
            state: What `state_dict()` returned.
        """


def attach_server(make: Callable[[], Server], post: ServerPost) -> Server:
    """The server `make()` builds, checked and tied to the backend's post that delivers its messages (for backends).

    Args:
        make: The strategy's factory, as given to `serve`.
        post: The backend's message service, which the server's `send` and timers go through.

    Returns:
        The server.

    Raises:
        TypeError: make() returned something that is not a Server.
    """
    server = make()
    if not isinstance(server, Server):
        raise TypeError(f"serve(make) needs make() to return an exogym.comm.Server, got {type(server).__name__}")
    server._post = post
    return server


def _check_dst(dst: object, num_nodes: int, src: int) -> int:
    if isinstance(dst, bool) or not isinstance(dst, int) or not (dst == SERVER or 0 <= dst < num_nodes):
        raise ValueError(f"dst must be a node rank in 0..{num_nodes - 1} or SERVER ({SERVER}), got {dst!r}")
    if dst == src:
        raise ValueError(f"node {src} named itself as the other end of a message; a node sends to and receives "
                         "from other nodes or SERVER")
    return dst


def _check_meta(meta: Mapping[str, float] | None) -> dict[str, float]:
    out = dict(meta or {})
    for k, v in out.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"a message's meta holds str keys and int/float values, got {k!r}: {v!r}")
    return out


def _message(tensor: torch.Tensor, dst: int, tag: int, meta: Mapping[str, float] | None,
             copy: bool) -> tuple[Any, Message]:
    c = _comm.current_transport()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(copy, bool):
        raise TypeError(f"copy must be True or False, got {copy!r}")
    payload = tensor.detach().clone() if copy else tensor.detach()
    message = Message(c.rank, _check_dst(dst, c.num_nodes, c.rank), payload, int(tag), _check_meta(meta))
    c.stats.add("send", message.nbytes, message.nbytes)
    return c, message


def isend(tensor: torch.Tensor, dst: int, *, tag: int = 0, meta: Mapping[str, float] | None = None,
          copy: bool = True) -> Any:
    """Send a copy of `tensor` (copy=False: the tensor itself) to node `dst` (or SERVER) and return at once.

    Args:
        tensor: what to send (copied now, so the caller may change its own at once; not with copy=False).
        dst: a node's rank, or SERVER.
        tag: an int the receiver may select on.
        meta: a few int/float values sent with it (8 bytes each).
        copy: False: `tensor` itself is sent, not a copy (as torch.distributed sends a buffer), for a tensor made
            only to be sent: the caller must never change it, since the receiver reads it when it arrives.

    Returns:
        A handle whose wait() returns when the message has arrived (the sender's clock moves to the arrival).

    Raises:
        ValueError: dst is not a rank or SERVER, or is the sender itself.
        TypeError: tensor is not a tensor, or meta holds other than str -> int/float.
    """
    c, message = _message(tensor, dst, tag, meta, copy)
    return c.send_message(message, blocking=False)


def send(tensor: torch.Tensor, dst: int, *, tag: int = 0, meta: Mapping[str, float] | None = None,
         copy: bool = True) -> None:
    """Send a copy of `tensor` (copy=False: the tensor itself) to node `dst` (or SERVER); returns once it has arrived
    (the transfer is communication time on the sender's clock).

    Args:
        tensor: what to send (copied now, unless copy=False).
        dst: a node's rank, or SERVER.
        tag: an int the receiver may select on.
        meta: a few int/float values sent with it (8 bytes each).
        copy: False: `tensor` itself is sent (isend's `copy`).

    Raises:
        ValueError: dst is not a rank or SERVER, or is the sender itself.
        TypeError: tensor is not a tensor, or meta holds other than str -> int/float.
    """
    c, message = _message(tensor, dst, tag, meta, copy)
    c.send_message(message, blocking=True)


def irecv(tensor: torch.Tensor | None = None, src: int | None = None, *, tag: int | None = None) -> Any:
    """Start receiving the next message from `src` with `tag`; the handle's `wait()` returns the Message.

    Args:
        tensor: If given, the message's tensor is copied into it when the handle is waited on.
        src: A node's rank, SERVER, or None for any sender.
        tag: The tag to match, or None for any.

    Returns:
        A handle whose `wait()` returns the Message.
    """
    c = _comm.current_transport()
    if src is not None:
        _check_dst(src, c.num_nodes, c.rank)
    return c.receive_message(src, tag, tensor, blocking=False)


def recv(tensor: torch.Tensor | None = None, src: int | None = None, *, tag: int | None = None) -> Message:
    """Receive the next message from `src` with `tag`, in arrival order (waiting for it is idle time).

    Args:
        tensor: if given, the message's tensor is copied into it.
        src: a node's rank, SERVER, or None for any sender.
        tag: the tag to match, or None for any.

    Returns:
        The Message (src, tensor, tag, meta, sent_at, arrives_at).

    Raises:
        MessageError: no message will ever match (every node that could send is finished or waits itself).
        ValueError: src is not a rank or SERVER.
    """
    c = _comm.current_transport()
    if src is not None:
        _check_dst(src, c.num_nodes, c.rank)
    return c.receive_message(src, tag, tensor, blocking=True)


def poll(src: int | None = None, *, tag: int | None = None) -> list[Message]:
    """Every message from `src` with `tag` that has arrived by this node's clock, in arrival order. Never waits.

    Args:
        src: A node's rank, SERVER, or None for any sender.
        tag: The tag to match, or None for any.

    Returns:
        The Messages, `[]` if none has arrived.
    """
    c = _comm.current_transport()
    if src is not None:
        _check_dst(src, c.num_nodes, c.rank)
    return c.poll_messages(src, tag)


def serve(make: Callable[[], Server]) -> Server | None:
    """Declare the run's server: every node calls it (in setup) with the same factory.

    The server is made once, where it runs, and returned there. On the sim backend every node gets a server: in
    node 0's process (every process, with processes=1) the server itself; in the other processes a shadow made by
    the same factory, which never handles a message and whose attributes are only as fresh as the last
    `read_server` of a node of that process. On the torch backend rank 0 gets the server and the other ranks a
    shadow, alike. Read the server's state from a node with `read_server`, never through the returned object's
    attributes.

    Args:
        make: A factory `make() -> Server`.

    Returns:
        The Server (the sim's other processes, the torch backend's ranks other than 0: its shadow).
    """
    return _comm.current_transport().serve(make)


def read_server(read: Callable[[Server], Any] | None = None) -> Any:
    """`read(server)` as of this node's clock.

    An observation, like `poll`: every message that arrived at the server before this node's clock has been
    handled first (later ones too, if other nodes observed at later clocks before this one's turn; what is read
    depends on simulated time only). On the sim backend, from any node of any process, with the same result as with
    processes=1: in a process other than node 0's, the node asks the process holding the server for its state at
    its turn (its `state_dict()`, clock, update rows and byte counts), loads it into the shadow `serve` returned,
    and calls `read` on the shadow. On the torch backend, from any rank, as of wall-clock order at the server: rank 0
    reads the server under the lock its handlers hold; another rank asks rank 0's server thread, which answers
    between two messages it handles (every message it took before the request, including this node's earlier ones,
    none after), and reads the answer in its shadow the same way. Reads are not counted as bytes.

    Args:
        read: A function of the server (default: `server.snapshot()`).

    Returns:
        What `read` returned.

    Raises:
        RuntimeError: the run has no server, or, read away from the server, its class does not define
            `state_dict` and `load_state_dict`.
        MessageError: (torch backend) rank 0's server did not answer within node_timeout and a grace.
    """
    return _comm.current_transport().read_server(read or (lambda server: server.snapshot()))


def now() -> float:
    """The calling node's clock: simulated seconds (sim backend with a time model), else seconds of its run."""
    return _comm.current_transport().now()
