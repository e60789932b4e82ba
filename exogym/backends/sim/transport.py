"""The sim backend: every node is a cooperative thread of this process, collectives are tensor ops.

Collectives are computed once, by the last member to arrive, in rank order, and written
into every member's tensors; nodes on different devices meet on the first member's device.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any, Callable, Sequence

import torch

from exogym.backends.sim.alone import AloneCheck
from exogym.backends.sim.baton import Baton, CollectiveCall, CollectiveError, Pending
from exogym.backends.sim.events import CollectiveTransfer
from exogym.backends.sim.postwork import SimRecvWork, SimSendWork
from exogym.backends.sim.watchdog import SpinWatch
from exogym.runs.checkpoint_checks import CheckpointError
from exogym.comm.messages import Message, Server
from exogym.comm.transport import CommStats, TransportBase, Group, ReduceOp, make_group, payload_nbytes, tensor_nbytes
from exogym.cluster.flows import Flow
from exogym.cluster.membership import Membership
from exogym.cluster.simtime import NodeClock, TimeModel


__all__ = ["SimTransport", "SimWork", "CollectiveError", "reduce_into"]


def _sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def reduce_into(acc: torch.Tensor, others: Sequence[torch.Tensor], op: ReduceOp) -> None:
    """acc <- op(acc, others...), applied left to right (rank order), so the result is deterministic; AVG sums
    (the caller divides once, by the whole group's size)."""
    for t in others:
        t = t.to(acc.device)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(t)
        elif op is ReduceOp.MAX:
            torch.maximum(acc, t, out=acc)
        elif op is ReduceOp.MIN:
            torch.minimum(acc, t, out=acc)
        else:
            acc.mul_(t)


def _reduce_into(acc: torch.Tensor, others: Sequence[torch.Tensor], op: ReduceOp, group_size: int) -> None:
    reduce_into(acc, others, op)
    if op is ReduceOp.AVG:
        acc.div_(group_size)


def _fold_arrivals(pending: Pending, ranks: Sequence[int], stack: bool = False) -> None:
    """A sum or mean: fold each member's tensor into one accumulator as soon as every lower-ranked member's is in
    (the same rank-order sum as at completion, so the same bits), and give back the memory of a tensor that owns
    its storage until its node resumes: K nodes waiting in a reduction hold one accumulator, not K buffers.

    `ranks`: the group's members in this process, in rank order (the whole group, or this process's block of it
    when the group crosses processes: the accumulator is then this process's part, exogym.backends.sim.
    collective_parts, and every member here waits on the other processes, so the last one gives its memory
    back too). `stack`: copy each tensor into a row of its own instead (an ordered sum's part in a process
    other than the leader's, which adds the rows after its own members')."""
    first = pending.calls.get(ranks[0])
    if first is None:
        return
    box = first.args.setdefault("fold", {"acc": None, "next": 0})
    while box["next"] < len(ranks) and ranks[box["next"]] in pending.calls:
        call = pending.calls[ranks[box["next"]]]
        t = call.args["tensor"]
        if stack:
            if box["acc"] is None:
                box["acc"] = torch.empty((len(ranks), *t.shape), dtype=t.dtype, device=t.device)
            box["acc"][box["next"]].copy_(t)
        elif box["acc"] is None:
            box["acc"] = t.detach().clone()
        else:
            box["acc"].add_(t.to(box["acc"].device))
        box["next"] += 1
        if len(pending.calls) < len(pending.group) and _owns_storage(t):
            t.untyped_storage().resize_(0)  # restored, with the result, when the node resumes (_restore)
            call.args["released"] = True
            if t.numel() * t.element_size() >= _LARGE:
                _trim_heap()


_LARGE = 32 << 20  # a reduction of a model this size (bytes): its nodes' transients are worth giving back
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform.startswith("linux") else None


def _trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim). A node reaching a large reduction has just
    freed its step's activations and gradients, in pieces small enough to live in the heap, where they would
    stay resident between the long-lived optimizer states of K nodes: at K=64 of a 10.7M-weight GPT, 0.2 GiB."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _owns_storage(t: torch.Tensor) -> bool:
    """Only a plain tensor that is its storage's whole (a flat buffer) can hand its memory back meanwhile."""
    return (t._base is None and t.storage_offset() == 0 and t.is_contiguous() and not t.requires_grad
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _release_gather_outputs(pending: Pending) -> None:
    """An all-gather: a waiting node's output buffers give back their memory until it resumes (K nodes waiting
    would otherwise hold K x K payloads; they hold the K inputs and, at completion, one copy of them)."""
    if len(pending.calls) == len(pending.group):
        return  # the last member completes the gather at once
    for call in pending.calls.values():
        if "outputs_released" in call.args:
            continue
        outs = call.args["tensor_list"]
        storages = {t.untyped_storage().data_ptr() for t in outs}  # distinct, and none is the input's
        release = (call.blocking and all(_owns_storage(t) for t in outs) and len(storages) == len(outs)
                   and call.args["tensor"].untyped_storage().data_ptr() not in storages)
        if release:
            for t in outs:
                t.untyped_storage().resize_(0)
        call.args["outputs_released"] = release


_TENSOR_ARGS = ("tensor", "tensor_list", "output", "input_list", "result", "gathered")


def _restore(call: CollectiveCall) -> None:
    """On the node's own turn after a collective completed: a released tensor gets its memory and the result.
    Then the call lets go of the node's tensors: the completed collective stays referenced until every member
    has resumed, and the node's buffers must not live that long (K nodes would hold K of them again)."""
    if call.args.pop("released", False):
        t = call.args["tensor"]
        t.untyped_storage().resize_(t.numel() * t.element_size())
        t.copy_(call.args["result"])
    if call.args.pop("outputs_released", False):
        for out, member in zip(call.args["tensor_list"], call.args["gathered"]):
            out.untyped_storage().resize_(out.numel() * out.element_size())
            out.copy_(member)
    for key in _TENSOR_ARGS:
        call.args.pop(key, None)


def _complete_all_reduce(calls: list[CollectiveCall]) -> None:
    tensors = [c.args["tensor"] for c in calls]
    op = calls[0].args["op"]
    box = calls[0].args.pop("fold", None)
    if box is not None:  # folded on arrival: the accumulator holds the rank-order sum
        acc = box["acc"]
        if op is ReduceOp.AVG:
            acc.div_(len(calls))
        for c in calls:
            if c.args.get("released"):
                c.args["result"] = acc  # copied in when that node resumes
            else:
                c.args["tensor"].copy_(acc)
        return
    # Reduce into the first member's tensor (no temporary), then copy the result to the others.
    _reduce_into(tensors[0], tensors[1:], op, len(tensors))
    for t in tensors[1:]:
        t.copy_(tensors[0])


def _complete_broadcast(calls: list[CollectiveCall]) -> None:
    src = calls[0].args["src"]
    source = next(c.args["tensor"] for c in calls if c.args["rank"] == src)
    for c in calls:
        if c.args["rank"] != src:
            c.args["tensor"].copy_(source)


def _complete_all_gather(calls: list[CollectiveCall]) -> None:
    # Released outputs are filled when their node resumes, from one copy of the inputs (whose owners may
    # change them once they run on).
    gathered = [c.args["tensor"].clone() for c in calls] if any(c.args.get("outputs_released") for c in calls) else None
    for c in calls:
        if c.args.get("outputs_released"):
            c.args["gathered"] = gathered
            continue
        for out, other in zip(c.args["tensor_list"], calls):
            out.copy_(other.args["tensor"])


def _complete_reduce_scatter(calls: list[CollectiveCall]) -> None:
    op = calls[0].args["op"]
    for i, c in enumerate(calls):
        out = c.args["output"]
        out.copy_(calls[0].args["input_list"][i])
        _reduce_into(out, [other.args["input_list"][i] for other in calls[1:]], op, len(calls))


_COMPLETE: dict[str, Callable[[list[CollectiveCall]], None]] = {
    "all_reduce": _complete_all_reduce,
    "broadcast": _complete_broadcast,
    "all_gather": _complete_all_gather,
    "reduce_scatter": _complete_reduce_scatter,
    "barrier": lambda calls: None,
}


class SimTransport(TransportBase):
    """Node `rank`'s side of the sim backend (implements `exogym.comm.transport.Transport`)."""

    on_step: Callable[[int], None] | None = None  # called with the rank as each step starts (the lookahead, postlink)

    @property
    def step(self) -> int | None:
        """The node's current step (from 1); setting it starts the step."""
        return self._step

    @step.setter
    def step(self, value: int | None) -> None:
        self._step = value
        if self.on_step is not None:  # over several processes: the floor to the keeper, or an event cut in (postlink)
            self.on_step(self.rank)

    def __init__(self, baton: Baton, rank: int, num_nodes: int, time_model: TimeModel | None = None,
                 membership: Membership | None = None, owner: Sequence[int] | None = None,
                 alone: AloneCheck | None = None):
        super().__init__(rank, num_nodes, membership)
        self.baton, self.time_model = baton, time_model
        self.owner = owner  # each node's process, when the run spans several (None: all in this one)
        self.alone = alone  # over processes on shared links: the check that a collective costed alone was alone
        self.match_steps = True  # the strategy's collectives_match_steps (set by the node)
        self.unwaited = 0  # async collectives whose transfer is a flow, not yet waited on (checkpoints refuse them)
        self._spin = SpinWatch(baton.node_timeout)  # polls that spin at one clock (exogym.backends.sim.watchdog)

    def _meet(self, name: str, group: Group, signature: tuple, account: bool, payload: int, async_op: bool,
              **args: Any) -> "SimWork | None":
        call = CollectiveCall(name, (name, *signature), dict(args, rank=self.rank, clock=self.clock,
                                                             arrival=self.clock.now), self.step, blocking=not async_op,
                              match_step=self.match_steps)
        complete = _COMPLETE[name]
        timed = account and self.time_model is not None
        crossing = self.owner is not None and any(self.owner[r] != self.owner[self.rank] for r in group.ranks)
        if timed:
            complete = functools.partial(self._complete_timed, complete, name, payload, group.ranks)
        leave_across = None
        if crossing and timed:  # across processes: the members here leave from the last arrival anywhere
            leave_across = functools.partial(self._leave, op=name, nbytes=payload, ranks=group.ranks)

        fold = None  # alone in the group there is nothing to fold, and no buffer to give back
        if name == "all_reduce" and group.size > 1 and args["op"] in (ReduceOp.SUM, ReduceOp.AVG):
            here = (group.ranks if not crossing  # across processes: this process's members fold into its part
                    else [r for r in group.ranks if self.owner[r] == self.owner[self.rank]])
            # An uncounted sum across processes is a measurement (the global model): summed member by member in
            # rank order, as in one process (exogym.backends.sim.collective_parts); the leader folds its own.
            ordered = crossing and not account
            leader = crossing and self.owner[self.rank] == min(self.owner[r] for r in group.ranks)
            call.args["ordered"] = ordered
            fold = functools.partial(_fold_arrivals, ranks=here, stack=ordered and not leader)
        elif name == "all_gather" and group.size > 1:
            fold = _release_gather_outputs
        pending = self.baton.rendezvous(self.rank, group.ranks, call, complete, fold, leave_across)
        if async_op:
            # on shared links its transfer is a flow, which a checkpoint does not save: counted until waited on
            in_flight = timed and payload > 0 and group.size > 1 and self.baton.messages.shares_collectives
            self.unwaited += in_flight
            return SimWork(self, pending, call, timed, in_flight)
        _restore(call)
        return None

    def _complete_timed(self, compute: Callable[[list[CollectiveCall]], None], op: str, nbytes: int,
                        ranks: tuple[int, ...], calls: list[CollectiveCall]) -> CollectiveTransfer | None:
        """A timed collective, its last member arrived: the tensors, then its members' clocks (`_leave`)."""
        compute(calls)
        return self._leave(calls, max(c.args["arrival"] for c in calls), op=op, nbytes=nbytes, ranks=ranks)

    def _leave(self, calls: list[CollectiveCall], start: float, *, op: str, nbytes: int,
               ranks: tuple[int, ...]) -> CollectiveTransfer | None:
        """The members here (`calls`) of a timed collective whose transfer starts at `start` (the last arrival, in any
        process): their clocks set at once by the formula, or (links shared with other transfers) a transfer whose
        flow's end sets them. Over processes every process holding a member makes the same transfer (the same route
        and start); one of them posts it to the keeper (exogym.backends.sim.events.poster)."""
        members = [(c.args["clock"], c.args["arrival"], c.blocking) for c in calls]

        def leave(flow: Flow | None = None) -> None:
            done_at = (self.time_model.leave(members, start, op, nbytes, ranks) if flow is None
                       else self.time_model.leave_flow(members, start, flow))
            for c in calls:
                c.args["done_at"] = done_at

        route = self.time_model.network.collective_route(op, nbytes, ranks) if self.baton.messages.shares_collectives \
            else None
        if route is None or not route.nbytes:  # (a barrier puts no bytes on a link: its latency alone, as the formula)
            self._check_alone(op, nbytes, ranks, start, calls[0].step)
            leave()
            return None
        holders = () if self.owner is None else tuple(sorted({self.owner[r] for r in ranks}))
        return CollectiveTransfer(start, route, leave, ranks[0], holders,
                                  tuple(c.args["rank"] for c in calls if c.blocking))

    def _check_alone(self, op: str, nbytes: int, ranks: tuple[int, ...], start: float, step: int | None) -> None:
        """Over processes on shared links: the collective costed alone must have been alone (exogym.backends.sim.
        alone). `step`: the step it was issued at."""
        if self.alone is not None:
            self.alone.check(self.time_model.network.collective_route(op, nbytes, ranks), start,
                             f"{op} on group {list(ranks)} issued at step {step}")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: Group, *, account: bool = False,
                   async_op: bool = False) -> "SimWork | None":
        if op is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"all_reduce with op=AVG needs a floating-point tensor, got {tensor.dtype}; "
                            "use SUM and divide")
        return self._meet("all_reduce", group, (*_sig(tensor), op.value), account, tensor_nbytes(tensor), async_op,
                          tensor=tensor, op=op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, *, account: bool = False,
                  async_op: bool = False) -> "SimWork | None":
        return self._meet("broadcast", group, (*_sig(tensor), f"src={src}"), account, tensor_nbytes(tensor),
                          async_op, tensor=tensor, src=src)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group, *,
                   account: bool = False, async_op: bool = False) -> "SimWork | None":
        return self._meet("all_gather", group, _sig(tensor), account, payload_nbytes("all_gather", tensor, group.size),
                          async_op, tensor_list=tensor_list, tensor=tensor)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp,
                       group: Group, *, account: bool = False, async_op: bool = False) -> "SimWork | None":
        return self._meet("reduce_scatter", group, (*_sig(output), op.value), account,
                          payload_nbytes("reduce_scatter", None, group.size, input_list), async_op,
                          output=output, input_list=input_list, op=op)

    def barrier(self, group: Group, *, account: bool = False, async_op: bool = False) -> "SimWork | None":
        return self._meet("barrier", group, (), account, 0, async_op)

    def new_group(self, ranks: Sequence[int]) -> Group:
        return make_group(ranks, self.num_nodes)

    # ---- point-to-point messages and the server (exogym.backends.sim.postoffice) -------------------
    def send_message(self, message: Message, *, blocking: bool) -> SimSendWork | None:
        message.sent_at = self.clock.now
        messages = self.baton.messages
        messages.post(message)
        if self.clock.spans is not None:  # the timeline's arrow, from send to arrival (shared links: once known)
            arrives = self.clock.spans.messages["arrives"]
            messages.arrow(message, arrives, len(arrives))
            self.clock.spans.sent(message.dst, message.sent_at, message.arrives_at, message.nbytes)
        work = SimSendWork(self.clock, message, lambda: messages.sent(self.rank, message))
        if blocking:
            work.wait()
            return None
        return work

    def receive_message(self, src: int | None, tag: int | None, into: torch.Tensor | None, *,
                        blocking: bool) -> Message | SimRecvWork:
        work = SimRecvWork(self, src, tag, into)
        return work.wait() if blocking else work

    def poll_messages(self, src: int | None, tag: int | None) -> list[Message]:
        at = self.clock.now
        self._spin.before(self.rank, self.step, at, self._others_turns(), "poll()")
        taken = self.baton.messages.arrived(self.rank, at, src, tag)
        self._spin.after(at, self._others_turns(), bool(taken))
        self.stats.bytes_received += sum(m.nbytes for m in taken)
        return taken

    def serve(self, make: Callable[[], Server]) -> Server | None:
        return self.baton.messages.serve(make)

    def read_server(self, read: Callable[[Server], Any]) -> Any:
        at = self.clock.now
        self._spin.before(self.rank, self.step, at, self._others_turns(), "read_server()")
        value = self.baton.messages.read(self.rank, at, read)
        self._spin.after(at, self._others_turns(), False)
        return value

    def _others_turns(self) -> int:
        """The turns the other nodes of this process were given: their progress while this one polls."""
        return self.baton.all_turns - self.baton.turns[self.rank]

    def pause_for_checkpoint(self) -> None:
        """A run with messages pauses at a checkpoint: every node waits until the last one gets there (their clocks
        move to its clock, as idle time), so the checkpoint is a cut in simulated time: what is in flight then is
        saved with it, and a resumed run continues exactly (exogym.backends.sim.postoffice)."""
        if not self.baton.messages.active:
            return
        self._refuse_unwaited()
        latest = torch.tensor([self.clock.now], dtype=torch.float64)
        self.all_reduce(latest, ReduceOp.MAX, self.world)
        self.clock.catch_up(float(latest))

    def _refuse_unwaited(self) -> None:
        """Before a checkpoint's cut: an async collective of this node's not yet waited on has its transfer on the
        wire as a flow (shared links), which the checkpoint does not save, so the checkpoint is refused before any of
        its files is written. Decided by the node's own calls, so the same in every process count (whether the flow
        has ended by then is not).

        Raises:
            CheckpointError: the node has an async collective not yet waited on.
        """
        if self.unwaited:
            raise CheckpointError(
                f"node {self.rank} reached a checkpoint at step {self.step} with {self.unwaited} async collective(s) "
                "not yet waited on: on shared links a collective's transfer is a flow, and a checkpoint does not save "
                "one on the wire. Wait on async collectives before a checkpoint's step ends, checkpoint at other "
                "steps, or cost transfers alone (Network(..., shared_links=False))")

    def restore(self, stats: CommStats, clock: NodeClock) -> None:
        super().restore(stats, clock)
        if clock.spans is not None:  # its messages on the wire at the checkpoint: their arrows land in its log
            self.baton.messages.log_arrivals(self.rank, clock.spans.messages["arrives"])

    def messages_state(self) -> dict[str, Any] | None:
        """The post office's state at the pause (node 0 keeps it in its checkpoint file), or None. Every node calls
        it (after its strategy's state, which waits for its async collectives)."""
        post = self.baton.messages
        if not post.active and post.shares_collectives:
            return self._links_cut()
        if self.rank != 0 or not post.active:
            return None
        world = self.world.ranks
        post.cut(world, self.baton.collectives_made(self.rank, world))  # the pause's messages from other processes
        return post.state_dict()

    def _links_cut(self) -> dict[str, Any] | None:
        """A run whose only flows are its collectives: the links' use at a cut, for node 0's file. Every node meets
        in an untimed barrier (no clock moves); the last to arrive, when every collective before it has ended and no
        node has gone on (one that had would have started its next transfers), takes the state."""
        post = self.baton.messages

        def take(calls: list[CollectiveCall]) -> None:
            post.links_cut = post.state_dict()

        self._refuse_unwaited()
        world = self.world.ranks
        call = CollectiveCall("barrier", ("barrier",), {"rank": self.rank, "arrival": self.clock.now}, self.step,
                              match_step=self.match_steps)
        self.baton.rendezvous(self.rank, world, call, take)
        if self.owner is not None and self.rank == 0:  # across processes (the keeper's flows) the barrier crosses and
            # `take` is not called: node 0 takes the state with the keeper, once every process's posts before it are in
            post.cut(world, self.baton.collectives_made(self.rank, world))
            post.links_cut = post.state_dict()
        return post.links_cut if self.rank == 0 and post.link_usage() else None

    def load_messages_state(self, state: dict[str, Any]) -> None:
        post = self.baton.messages
        post.load_state_dict(state)  # nothing, when the backend read it before any node ran
        post.check_loaded()

    def served(self) -> Server | None:
        """The run's server, if a strategy declared one (its record goes with node 0's log)."""
        return self.baton.messages.server

    def link_usage(self) -> dict[str, dict[str, float]] | None:
        """Each link's busy seconds and bytes (shared links; None otherwise; node 0's log keeps it)."""
        return self.baton.messages.link_usage()

    def link_spans(self) -> dict[str, dict[str, Any]] | None:
        """Each link's busy spans (shared links; None otherwise; node 0's log keeps them for the timeline)."""
        return self.baton.messages.link_spans()



class SimWork:
    """The handle of an async collective (torch.distributed's Work): results are in the tensors after wait()."""

    def __init__(self, comm: SimTransport, pending: Pending, call: CollectiveCall, timed: bool, counted: bool = False):
        self._comm, self._pending, self._call, self._timed = comm, pending, call, timed
        self._counted = counted  # in comm.unwaited until the first wait

    def is_completed(self) -> bool:
        return self._pending.done

    def wait(self, timeout: Any = None) -> bool:
        self._comm.baton.wait(self._comm.rank, self._pending)
        if self._counted:
            self._counted = False
            self._comm.unwaited -= 1
        _restore(self._call)
        if self._timed:
            self._comm.clock.catch_up(self._call.args["done_at"])
        return True
