"""TorchTransport: one node's collectives over torch.distributed (the torch backend's `exogym.comm.transport.Transport`).

The semantics are the sim backend's (exogym.backends.sim); where torch.distributed differs, this file makes up
the difference:
- AVG is a SUM followed by a division by the group size on every process group (gloo has no AVG in older builds,
  and the sim divides the same way); floats only.
- reduce_scatter: nccl's own. On gloo, one all-reduce of the stacked inputs, from which member i keeps row i: the
  same result (member i gets the reduction over members of their input_list[i]), and the same traffic as gloo's
  own reduce_scatter (one all-reduce per chunk), which older builds lack.
- A tensor the process group cannot use as it is (gloo: not on the CPU; nccl: not on this node's GPU; either: not
  contiguous) goes through a staging copy, and the result is copied back.
- A group of one node never touches the network.
- Simulated time: when the run has a time model, each counted collective is followed, on the same group, by an
  all-gather of the members' arrival times (float64), and every member settles its own clock as the sim does.
- Members that call different collectives: torch.distributed aborts a process or times out without saying what
  differed; each call's signature (op, shapes, dtypes, reduce op or src, as the sim's) goes to the node's ledger in
  the run's store before it is launched, and a failed or timed-out collective is explained from the members'
  ledgers (exogym.backends.torch.heartbeat): a CollectiveError naming each node's call, as on the sim.
Bytes are counted by exogym.comm.collectives before a call gets here, exactly as on the sim backend.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from exogym.backends.torch.heartbeat import (CollectiveLedger, Heartbeat, is_timeout, mismatch_report,
                                             missing_members_report)
from exogym.backends.errors import NodeTimeoutError, PeerLostError
from exogym.backends.peer_watch import BEAT_S
from exogym.backends.torch.messages import TorchPostOffice, _RecvWork
from exogym.backends.torch.server_watch import ServerWatch
from exogym.cluster.network import SERVER
from exogym.comm.transport import CollectiveError, TransportBase, Group, ReduceOp, make_group, payload_nbytes, tensor_nbytes
from exogym.cluster.simtime import NodeClock, TimeModel

__all__ = ["TorchTransport", "TorchWork"]


_PEER_POLL = timedelta(seconds=BEAT_S)  # how often a waiting collective looks at the members' heartbeats


def _torch_op(op: ReduceOp) -> Any:
    """torch.distributed's op for ours; AVG is a SUM here, divided afterwards."""
    return getattr(dist.ReduceOp, "SUM" if op is ReduceOp.AVG else op.name)


class TorchWork:
    """The handle of a collective (torch.distributed's Work): results are in the caller's tensors after wait().

    `check_peers` (gloo only): called every PeerWatch beat while the collective waits; it raises PeerLostError when
    a member's process stopped responding (exogym.backends.peer_watch), so that a stopped process is named within
    fit's peer_timeout rather than when the process group times out (node_timeout).
    """

    def __init__(self, works: list[Any], finish: Callable[[], None], what: str,
                 explain: Callable[[BaseException], BaseException | None] = lambda e: None,
                 check_peers: Callable[[], None] | None = None):
        self._works, self._finish, self._done, self._what = works, finish, False, what
        self._explain = explain  # a better error for a failed wait (a timeout: who never came), or None
        self._check_peers = check_peers

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            try:
                for w in self._works:
                    self._wait_one(w)
            except PeerLostError:
                raise
            except Exception as e:  # a timeout or a peer gone: say which collective was waiting
                better = self._explain(e)
                if better is not None:
                    raise better from e
                e.add_note(f"(waiting in {self._what})")
                raise
            self._done = True
            with torch.no_grad():
                self._finish()  # post-processing: AVG's division, copies out of staging, the clock
        return True

    def _wait_one(self, work: Any) -> None:
        if self._check_peers is None:
            work.wait()
            return
        while True:  # a wait with a timeout leaves the collective running; only the wait gives up
            try:
                work.wait(timeout=_PEER_POLL)
                return
            except RuntimeError as e:
                if not str(e).startswith("Operation timed out!"):
                    raise
            self._check_peers()


class TorchTransport(TransportBase):
    """Node `rank`'s side of the torch backend, in a process where torch.distributed is initialised with
    world size `num_nodes` (rank r of the default group is node r)."""

    def __init__(self, rank: int, num_nodes: int, *, device: torch.device, backend: str,
                 timeout: timedelta, time_model: TimeModel | None = None):
        super().__init__(rank, num_nodes)  # no failure schedule: real processes do not fail on one
        self.time_model = time_model
        self.device = device if backend == "nccl" else torch.device("cpu")  # where the process group works
        self.backend, self.timeout = backend, timeout
        self._process_groups: dict[tuple[int, ...], Any] = {}  # ranks -> torch ProcessGroup (or NON_GROUP_MEMBER)
        self.ledger = CollectiveLedger()  # the collectives entered, for naming who never came when one times out
        self.heartbeat: Heartbeat | None = None  # publishes the ledger (set by the backend when it has a store)
        self.check_peers: Callable[[], None] | None = None  # raises PeerLostError for a stopped member (gloo)
        self.messages = TorchPostOffice(rank, num_nodes, timeout.total_seconds())  # messages and the server
        self._server_watch: ServerWatch | None = None  # rank 0, once a server runs: names a stuck handler

    # ---- point-to-point messages and the server (exogym.backends.torch.messages) -------------------
    def send_message(self, message: Any, *, blocking: bool) -> Any:
        work = self.messages.post(message)
        return None if blocking else work

    def _what(self, src: int | None, tag: int | None) -> str:
        who = "any node" if src is None else "the server" if src == SERVER else f"node {src}"
        return f"recv from {who}" + ("" if tag is None else f" with tag {tag}") + f" at step {self.step}"

    def receive_message(self, src: int | None, tag: int | None, into: torch.Tensor | None, *, blocking: bool) -> Any:
        def take() -> Any:
            m = self.messages.take(src, tag, self._what(src, tag))[0]
            self.stats.bytes_received += m.nbytes
            if into is not None:
                into.copy_(m.tensor)
            return m
        work = _RecvWork(take)
        return work.wait() if blocking else work

    def poll_messages(self, src: int | None, tag: int | None) -> list[Any]:
        taken = self.messages.take(src, tag, "poll", wait=False)
        self.stats.bytes_received += sum(m.nbytes for m in taken)
        return taken

    def serve(self, make: Any) -> Any:
        """The server (rank 0) or its shadow (the other ranks: read_server loads it)."""
        server = self.messages.serve(make)
        if self.rank == 0 and self._server_watch is None:
            self._server_watch = ServerWatch(self.messages, self.messages.timeout_s).start()
        return server

    def read_server(self, read: Any) -> Any:
        """`read(server)`: on rank 0 under the lock its handlers hold; elsewhere on the shadow, loaded with the
        server's state as rank 0's server thread answers (exogym.backends.torch.server_reads)."""
        if self.messages.server is None:
            raise RuntimeError("read_server: the run has no server (declare one with exogym.comm.serve)")
        if self.rank != 0:
            return self.messages.read(read, f"read_server at step {self.step}")
        while not self.messages.server_lock.acquire(timeout=1.0):  # held by a handler: a stuck one is named by the watch
            if self._server_watch is not None and self._server_watch.error is not None:
                raise self._server_watch.error
        try:
            return read(self.messages.server)
        finally:
            self.messages.server_lock.release()

    def served(self) -> Any:
        return self.messages.server

    def now(self) -> float:
        """Wall-clock seconds since this node's transport was made (messages run in real time here)."""
        return self.messages.now()

    def close_messages(self) -> None:
        try:
            self.messages.close()
        finally:
            if self._server_watch is not None:
                self._server_watch.stop()

    # ---- groups ------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> Group:
        """The group of `ranks`, with its torch process group made the first time these ranks are asked for.

        torch.distributed requires every process (members or not) to call dist.new_group for every group, in the
        same order. So the first time each distinct group is made, every node must make it, in the same order:
        strategies call exogym.comm.collectives.new_group on every node, in the same order (as
        CommunicateOptimizeStrategy does), and keep the Group. The world and one-node groups need no process group.
        """
        g = make_group(ranks, self.num_nodes)
        if g.size > 1 and g != self.world and g.ranks not in self._process_groups:
            self._process_groups[g.ranks] = dist.new_group(list(g.ranks), timeout=self.timeout)
        return g

    def _process_group(self, group: Group, op: str) -> Any:
        if group == self.world:
            return None  # torch's default group
        if group.ranks not in self._process_groups:
            raise CollectiveError(
                f"node {self.rank} (step {self.step}) called {op} on group {list(group.ranks)}, which was never made "
                f"with new_group: on the torch backend every node (members or not) must first call "
                f"exogym.comm.collectives.new_group({list(group.ranks)}), in the same order on every node, "
                "and pass the Group it returns")
        return self._process_groups[group.ranks]

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Group, *, account: bool = False,
                   async_op: bool = False) -> TorchWork | None:
        if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"all_reduce with op=AVG needs a floating-point tensor, got {tensor.dtype}; "
                            "use SUM and divide")
        buf = self._staged(tensor)

        def finish() -> None:
            if op is ReduceOp.AVG:
                buf.div_(group.size)
            _copy_back(tensor, buf)
        return self._collective("all_reduce", (*_sig(tensor), op.value), group, tensor_nbytes(tensor), account,
                                async_op, finish,
                                lambda pg: dist.all_reduce(buf, op=_torch_op(op), group=pg, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, account: bool = False,
                  async_op: bool = False) -> TorchWork | None:
        buf = self._staged(tensor)
        return self._collective("broadcast", (*_sig(tensor), f"src={src}"), group, tensor_nbytes(tensor), account,
                                async_op,
                                lambda: _copy_back(tensor, buf),
                                lambda pg: dist.broadcast(buf, src=src, group=pg, async_op=True))

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group, *,
                   account: bool = False, async_op: bool = False) -> TorchWork | None:
        buf, outs = self._staged(tensor), [self._staged(t) for t in tensor_list]

        def finish() -> None:
            if group.size == 1:
                outs[0].copy_(buf)
            for t, out in zip(tensor_list, outs):
                _copy_back(t, out)
        return self._collective("all_gather", _sig(tensor), group, payload_nbytes("all_gather", tensor, group.size),
                                account, async_op, finish,
                                lambda pg: dist.all_gather(outs, buf, group=pg, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp,
                       group: Group, *, account: bool = False, async_op: bool = False) -> TorchWork | None:
        if op is ReduceOp.AVG and not (output.is_floating_point() or output.is_complex()):
            raise TypeError(f"reduce_scatter with op=AVG needs floating-point tensors, got {output.dtype}; "
                            "use SUM and divide")
        out, me = self._staged(output), group.ranks.index(self.rank)
        native = self.backend == "nccl"
        if native:
            ins = [self._staged(t) for t in input_list]
        else:
            stacked = torch.stack([t.to(self.device) for t in input_list])  # [R, *shape]: row i goes to member i

        def finish() -> None:
            if group.size == 1 or not native:
                out.copy_(input_list[0] if group.size == 1 else stacked[me])
            if op is ReduceOp.AVG:
                out.div_(group.size)
            _copy_back(output, out)

        def launch(pg: Any) -> Any:
            if native:
                return dist.reduce_scatter(out, ins, op=_torch_op(op), group=pg, async_op=True)
            return dist.all_reduce(stacked, op=_torch_op(op), group=pg, async_op=True)
        return self._collective("reduce_scatter", (*_sig(output), op.value), group,
                                payload_nbytes("reduce_scatter", None, group.size, input_list), account, async_op,
                                finish, launch)

    def barrier(self, group: Group, *, account: bool = False, async_op: bool = False) -> TorchWork | None:
        # A one-element all-reduce rather than dist.barrier: the same on gloo and nccl, and it can be async.
        token = torch.zeros(1, device=self.device)
        return self._collective("barrier", (), group, 0, account, async_op, lambda: None,
                                lambda pg: dist.all_reduce(token, group=pg, async_op=True))

    # ---- the shared path ---------------------------------------------------------------------
    def _collective(self, op: str, signature: tuple, group: Group, payload: int, account: bool, async_op: bool,
                    finish: Callable[[], None], launch: Callable[[Any], Any]) -> TorchWork | None:
        """Start the collective (and, when timed, the arrival-time exchange right after it on the same group, so
        every member issues them in the same order); wait now unless async_op. `signature` must be equal across
        members (shapes, dtypes, reduce op or src); it is published before the launch, to name a mismatch."""
        works, timed = [], account and self.time_model is not None
        arrivals: list[Any] = [self.clock.now]  # the members' arrival times on their virtual clocks, in rank order
        number, step = 0, self.step
        if group.size > 1:
            pg = self._process_group(group, op)
            number = self.ledger.enter(op, group.ranks, step, signature)
            if self.heartbeat is not None:
                self.heartbeat.publish_call()  # on record before launching: a mismatch may abort this process
            works.append(launch(pg))
            if timed:
                mine = torch.tensor(arrivals, dtype=torch.float64, device=self.device)
                arrivals = [torch.empty_like(mine) for _ in group.ranks]
                works.append(dist.all_gather(arrivals, mine, group=pg, async_op=True))

        def done() -> None:
            finish()
            if timed:
                self._settle(op, group, payload, [float(a) for a in arrivals], blocking=not async_op)
        work = TorchWork(works, done, f"{op} on group {list(group.ranks)}, called at step {self.step}",
                         lambda e: self._explain(e, op, group, number, step),
                         self.check_peers if self.backend == "gloo" else None)
        if async_op:
            return work
        work.wait()
        return None

    def _explain(self, e: BaseException, op: str, group: Group, number: int, step: int | None) -> Exception | None:
        """A failed collective, from the members' ledgers: a CollectiveError naming each node's call when they
        differ; else, on a timeout, a NodeTimeoutError naming the members that never entered it; else None. On rank
        0 with a stuck server, the server watch's ServerTimeoutError: the members that never came wait for it."""
        stuck = self._server_watch.verdict(self.messages) if self._server_watch is not None else None
        if stuck is not None:
            return stuck
        if self.heartbeat is None:
            return None
        ledgers = self.heartbeat.read(group.ranks)
        mismatch = mismatch_report(self.rank, group.ranks, self.ledger.recent.get(group.ranks, ()), ledgers)
        if mismatch is not None:
            how = (f"waited {self.timeout.total_seconds():g} s (fit's node_timeout) in {op} #{number}" if is_timeout(e)
                   else f"saw {op} #{number} fail ({type(e).__name__}: a member's process may have been aborted)")
            return CollectiveError(f"{mismatch}\nNode {self.rank} {how}; the run was stopped.")
        if not is_timeout(e):
            return None
        message, missing = missing_members_report(self.rank, op, group.ranks, number, step, self.timeout, ledgers)
        culprit = missing[0] if missing else self.rank
        culprit_step = (ledgers.get(culprit) or {}).get("step", step)
        return NodeTimeoutError(message, culprit, culprit_step)

    def _settle(self, op: str, group: Group, payload: int, arrivals: list[float], *, blocking: bool) -> None:
        """This node's clock after the collective, by the sim's rule (TimeModel.settle): the transfer starts at the
        last arrival and lasts the network's duration. The other members settle their own clocks alike."""
        members = [(self.clock if r == self.rank else NodeClock(), a, blocking if r == self.rank else True)
                   for r, a in zip(group.ranks, arrivals)]
        done_at = self.time_model.settle(members, op, payload, group.ranks)
        if not blocking:
            self.clock.catch_up(done_at)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """`t` itself when the process group can work on it, else a contiguous copy on the group's device."""
        if t.device == self.device and t.is_contiguous():
            return t
        return t.detach().to(self.device).contiguous()


def _sig(t: torch.Tensor) -> tuple:
    """A tensor's part of a collective's signature, as the sim writes it (exogym.backends.sim.transport)."""
    return (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _copy_back(original: torch.Tensor, buf: torch.Tensor) -> None:
    if buf is not original:
        original.copy_(buf)
