"""Point-to-point messages and the server on the torch backend: real asynchronous messages over torch.distributed.

Each process (one node) runs a receiver thread, started with the node's first message call: it takes every
message meant for this process (a header from any sender, then that sender's meta and tensor) and puts it in the
node's mailbox or, in rank 0's process, in the server's queue. The server (a strategy's `Server`) runs on a
thread of rank 0's process and handles its queue in the order messages came in; a node's `recv` waits on its
mailbox. Times are wall-clock seconds since the node's transport was made; what a node reads depends on real
timing (as on a cluster), unlike the sim backend, where the simulated clock decides.

Why no message is taken out of order between two processes: a sender sends a message's header, meta and tensor
under one lock, in that order, and torch.distributed delivers the messages of one (sender, receiver, tag) pair in
the order they were sent; the receiver takes a header from any sender, then that sender's meta and tensor by its
rank. So a sender's messages arrive in the order it sent them, each whole.

A rank other than 0 reads the server (`read`) with a request of its own kind to rank 0, which the server's thread
answers between two messages with the server's state (exogym.backends.torch.server_reads); `serve` returns a shadow
server there, which the answer is loaded into.

The end: every process sends each other a stop header after its last message and waits for everyone's; the
server's queue is then complete, and no receive is left posted when the process group goes down. Rank 0 sends its
stops last, once its server has stopped, so that the answer to a read is in before a reader's receiver ends.

How long the receiver waits for the next header: without limit (`_NEVER`), not the process group's timeout
(node_timeout). Hearing nothing for a while is no fault: a node of an asynchronous strategy hears only the server's
answer to its last round, and a round of many steps may take longer than node_timeout, which bounds one step. A
gloo receive that times out also breaks the process's every link ("Application timeout caused pair closure"), so the
receiver cannot wait in slices either. What a node waits for is bounded where it waits (`take`, `close`:
node_timeout and a grace), a peer that dies closes the connection, which ends the receiver's wait, and one that
stops is named by the peer watch.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from exogym.backends.errors import NodeTimeoutError
from exogym.backends.server_state import ShadowPost, check_readable
from exogym.backends.torch.server_reads import ReadRequest, decode_state, encode_state, load_answer
from exogym.backends.torch.server_watch import wait_grace
from exogym.cluster.network import SERVER
from exogym.comm.messages import Message, Server, attach_server
from exogym.comm.transport import MessageError

__all__ = ["TorchPostOffice"]

_HEADER, _BODY = 7001, 7002  # torch.distributed tags of headers and of metas and tensors
_MESSAGE, _STOP, _READ, _STATE = 0, 1, 2, 3  # header kinds: a message, the end, a read_server request, its answer
_NEVER = timedelta(days=365)
_SERVER_HOME = "rank 0's process"  # where the server runs, for the shadows' errors  # the receiver's wait for the next header (see above)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
           torch.int8, torch.int16, torch.bool]


class _SendWork:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class _RecvWork:
    def __init__(self, take: Callable[[], Message]):
        self._take, self._message = take, None

    def is_completed(self) -> bool:
        return self._message is not None

    def wait(self, timeout: Any = None) -> Message:
        if self._message is None:
            self._message = self._take()
        return self._message


class TorchPostOffice:
    """One process's messages: its mailbox, its receiver thread, and (rank 0) the server and its thread."""

    def __init__(self, rank: int, num_nodes: int, timeout_s: float):
        self.rank, self.num_nodes, self.timeout_s = rank, num_nodes, timeout_s
        self.t0 = time.perf_counter()
        self._mail: list[Message] = []
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._stops = 0
        self.server: Server | None = None
        self._server_queue: queue.Queue = queue.Queue()
        self._server_thread: threading.Thread | None = None
        self.server_lock = threading.Lock()
        self._error: BaseException | None = None
        self._sent = 0
        self._reads: dict[int, torch.Tensor] = {}  # read_server answers, by request number, until their reader runs
        self._asked = 0  # read_server requests sent
        self.closed = False
        # ---- the server watch's hook (exogym.backends.torch.server_watch) ----
        self.handling: tuple[Any, float] | None = None  # (the item the server handles, time.monotonic() it began)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---- sending -------------------------------------------------------------------------------
    def post(self, message: Message) -> _SendWork:
        self._start()
        message.sent_at = message.arrives_at = self.now()
        if message.src != SERVER:
            message.seq, self._sent = self._sent, self._sent + 1
        process = 0 if message.dst == SERVER else message.dst
        if process == self.rank:  # the server in this process, or the server answering node 0
            self._arrived(message)
            return _SendWork()
        tensor = message.tensor.detach().to("cpu").contiguous()
        meta = torch.frombuffer(bytearray(json.dumps(message.meta).encode()), dtype=torch.uint8)
        header = torch.tensor([_MESSAGE, message.src, message.dst, message.tag, message.seq, tensor.numel(),
                               _DTYPES.index(tensor.dtype), meta.numel(), self.rank], dtype=torch.int64)
        with self._send_lock:  # header, meta, tensor in a row: the receiver takes them by our rank
            dist.send(header, process, tag=_HEADER)
            if meta.numel():
                dist.send(meta, process, tag=_BODY)
            if tensor.numel():
                dist.send(tensor.reshape(-1), process, tag=_BODY)
        return _SendWork()

    # ---- receiving -----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._receiver is None and self.num_nodes > 1:
            self._receiver = threading.Thread(target=self._receive_loop, name=f"exogym-messages-{self.rank}",
                                              daemon=True)
            self._receiver.start()

    def _receive_loop(self) -> None:
        try:
            while self._stops < self.num_nodes - 1:
                header = torch.empty(9, dtype=torch.int64)
                dist.irecv(header, tag=_HEADER).wait(timeout=_NEVER)  # from any process, which the header names
                kind, src, dst, tag, seq, numel, dtype, meta_len, src_process = header.tolist()
                if kind == _STOP:
                    with self._cv:
                        self._stops += 1
                        self._cv.notify_all()
                    continue
                meta = torch.empty(meta_len, dtype=torch.uint8)
                if meta_len:
                    dist.recv(meta, src_process, tag=_BODY)
                tensor = torch.empty(numel, dtype=_DTYPES[dtype])
                if numel:
                    dist.recv(tensor, src_process, tag=_BODY)
                if kind != _MESSAGE:  # a read_server request (rank 0) or its answer (its reader)
                    self._read_arrived(kind, src, tag, seq, tensor)
                    continue
                message = Message(src, dst, tensor, tag, json.loads(bytes(meta.tolist()).decode()) if meta_len else {},
                                  seq=seq)
                message.arrives_at = self.now()
                self._arrived(message)
        except BaseException as e:  # noqa: BLE001 - a broken process group: the node's next wait says so
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _arrived(self, message: Message) -> None:
        if message.dst == SERVER:
            self._server_queue.put(message)
            return
        with self._cv:
            self._mail.append(message)
            self._cv.notify_all()

    def take(self, src: int | None, tag: int | None, what: str, *, wait: bool = True) -> list[Message]:
        """The first matching message (waiting up to the run's timeout), or with wait=False every matching one."""
        self._start()
        deadline = time.monotonic() + self.timeout_s + wait_grace(self.timeout_s)  # a stuck server is named first
        with self._cv:
            while True:
                self._raise_if_failed(what)
                found = [m for m in self._mail if (src is None or m.src == src) and (tag is None or m.tag == tag)]
                if found and wait:
                    self._mail = [m for m in self._mail if m is not found[0]]  # not remove's ==: tensors
                    return [found[0]]
                if not wait:
                    self._mail = [m for m in self._mail if not any(m is f for f in found)]  # not ==: tensors
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MessageError(f"node {self.rank} waited {self.timeout_s + wait_grace(self.timeout_s):g} s "
                                       f"(fit's node_timeout and a grace) in {what} and nothing came")
                self._cv.wait(timeout=min(left, 1.0))

    def _raise_if_failed(self, what: str) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, NodeTimeoutError):  # the server watch's: raised as itself (the run ends stuck)
                raise error
            raise MessageError(f"node {self.rank} in {what}: {error}") from error

    def fail(self, error: BaseException) -> None:
        """The server watch found the server stuck: this process's next message call, or its wait in one, raises
        `error`."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    # ---- the server ------------------------------------------------------------------------------
    def serve(self, make: Callable[[], Server]) -> Server:
        """The server (rank 0, which runs it on a thread) or its shadow (made by `make()` at the first call)."""
        # Every node of a run with a server receives from the start: a node that never sends (it reached a time
        # budget before its first round) still takes the others' stop headers at the end (close), so none blocks.
        self._start()
        if self.rank != 0:
            if self.server is None:
                self.server = attach_server(make, ShadowPost(self.num_nodes, _SERVER_HOME))
            return self.server
        if self.server is None:
            self.server = attach_server(make, self)
            self._server_thread = threading.Thread(target=self._serve_loop, name="exogym-server", daemon=True)
            self._server_thread.start()
        return self.server

    def wake_server(self, at: float) -> None:
        delay = max(0.0, at - self.now())
        threading.Timer(delay, lambda: self._server_queue.put(("wake", at))).start()

    def _serve_loop(self) -> None:
        server = self.server
        while True:
            item = self._server_queue.get()
            if item is None:
                return
            self.handling = (item, time.monotonic())
            try:
                with self.server_lock, torch.no_grad():
                    if isinstance(item, ReadRequest):  # between two messages, so the state is whole; not a message
                        state = encode_state(server, item.known)
                        self._send(item.rank, [_STATE, SERVER, item.rank, 0, item.number], state)
                        continue
                    server.now = self.now()
                    if isinstance(item, tuple):
                        server.wake(item[1])
                    else:
                        server.stats.bytes_received += item.nbytes
                        server.receive(item)
            except BaseException as e:  # noqa: BLE001 - node 0 raises it, naming the message
                what = item.describe() if hasattr(item, "describe") else f"its timer at {item[1]:.6g} s"
                with self._cv:
                    self._error = MessageError(f"the server ({type(server).__name__}) raised while handling {what}: "
                                               f"{type(e).__name__}: {e}")
                    self._error.__cause__ = e
                    self._cv.notify_all()
                return
            finally:
                self.handling = None

    # ---- read_server from a rank other than 0 (exogym.backends.torch.server_reads) ---------------------
    def read(self, read: Callable[[Server], Any], what: str) -> Any:
        """`read(shadow)`, the shadow loaded with the server's state as rank 0's server thread answers this node's
        request (between two messages it handles); waits as long as a recv (node_timeout and a grace).

        Raises:
            RuntimeError: the server's class keeps no state_dict, or the run's messages have ended.
            MessageError: no answer came in that time (a server stuck or gone), or the process group broke.
        """
        check_readable(self.server, self.rank, _SERVER_HOME)
        if self.closed:
            raise RuntimeError(f"read_server on node {self.rank} after the run's messages ended: the server is stopped")
        number, self._asked = self._asked, self._asked + 1
        known = len(self.server.updates)
        self._send(0, [_READ, self.rank, SERVER, known, number], None)
        wait_s = self.timeout_s + wait_grace(self.timeout_s)  # a stuck server is named first, by rank 0
        deadline = time.monotonic() + wait_s
        with self._cv:
            while number not in self._reads:
                self._raise_if_failed(what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MessageError(f"node {self.rank} waited {wait_s:g} s (fit's node_timeout and a grace) in "
                                       f"{what} and the server (in rank 0's process) did not answer")
                self._cv.wait(timeout=min(left, 1.0))
            payload = self._reads.pop(number)
        load_answer(self.server, decode_state(payload), known)
        return read(self.server)

    def _read_arrived(self, kind: int, src: int, known: int, number: int, payload: torch.Tensor) -> None:
        if kind == _READ:  # rank 0: the server's thread answers it in turn with the messages
            self._server_queue.put(ReadRequest(src, number, known))
            return
        with self._cv:
            self._reads[number] = payload
            self._cv.notify_all()

    def _send(self, process: int, head: list[int], payload: torch.Tensor | None) -> None:
        """A header of `head` (kind, src, dst, tag, seq) and a uint8 payload, in a row, to `process`."""
        numel = 0 if payload is None else payload.numel()
        header = torch.tensor([*head, numel, _DTYPES.index(torch.uint8), 0, self.rank], dtype=torch.int64)
        with self._send_lock:
            dist.send(header, process, tag=_HEADER)
            if numel:
                dist.send(payload, process, tag=_BODY)

    # ---- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """After the node's last message: tell every other process, wait for theirs, stop the server. Rank 0 tells
        the others last, once its server has answered every read (or the end failed: then at once)."""
        self.closed = True
        if self._receiver is None:
            return
        if self.rank != 0:
            self._send_stops()
            self._end()
            return
        try:
            self._end()
        except BaseException:
            with contextlib.suppress(Exception):  # the others end as before; this error is the run's
                self._send_stops()
            raise
        self._send_stops()

    def _send_stops(self) -> None:
        stop = torch.tensor([_STOP, self.rank, -2, 0, 0, 0, 0, 0, self.rank], dtype=torch.int64)
        with self._send_lock:
            for process in range(self.num_nodes):
                if process != self.rank:
                    dist.send(stop, process, tag=_HEADER)

    def _end(self) -> None:
        """Wait for every other process's stop, then stop the server (rank 0)."""
        deadline = time.monotonic() + self.timeout_s + wait_grace(self.timeout_s)  # a stuck server is named first
        with self._cv:
            while self._stops < self.num_nodes - 1:
                self._raise_if_failed("the end of the run's messages")
                if time.monotonic() > deadline:
                    raise MessageError(f"node {self.rank} waited {self.timeout_s + wait_grace(self.timeout_s):g} s "
                                       "(fit's node_timeout and a grace) for the other nodes to finish their messages")
                self._cv.wait(timeout=1.0)
        self._receiver.join()
        if self._server_thread is not None:
            self._server_queue.put(None)
            while self._server_thread.is_alive():  # a stuck server: the watch fails the post office, raised here
                self._server_thread.join(timeout=1.0)
                with self._cv:
                    self._raise_if_failed("the end of the run")
            with self._cv:
                self._raise_if_failed("the end of the run")
