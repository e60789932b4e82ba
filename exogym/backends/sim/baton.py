"""The baton: K nodes as cooperative threads (greenlets) of the caller's thread, one running at a time, taking
turns in the run's one event queue (exogym.backends.sim.events).

A node runs until it enters a collective or observes (a `recv`, a `poll`, a `read_server`, a send's wait), then hands
the baton back to the scheduler (the caller's greenlet), which takes the next entry of the queue in simulated-time
order: a node that may run (at its clock), or an event of the messages (exogym.backends.sim.postoffice: a transfer
starting or ending, a message arriving, a server's timer, an observation's turn). When the last member of a group
arrives, the collective is computed once (by that node, in rank order) and every member may run again from its
clock after the collective (with shared links, once the collective's transfer has ended).

Why greenlets rather than OS threads: torch's OpenMP pool belongs to the OS thread that opens
a parallel region, so K OS threads taking turns keep waking K cold pools; measured on 2 cores
(benchmarks/bench_sim.py), 8 thread-nodes of a small CNN ran 3.4x slower than one loop doing
the same arithmetic, while greenlets share one warm pool. Everything runs on one OS thread,
so no state here needs a lock, and nothing can hang: a collective that cannot complete
(mismatched calls, a member that finished or waits elsewhere) is an error the moment it is
certain, naming the nodes, their steps and their calls; a node that keeps the baton without
finishing a step or reaching a collective for node_timeout seconds is stopped by the watchdog
(exogym.backends.sim.watchdog), which names it, its step and its Python stack (and ends the process, when the run
asks for it, if the node is stuck in native code that no signal reaches).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import greenlet

from exogym.backends.sim.events import EventQueue
from exogym.backends.sim.watchdog import Watchdog, WatchdogInterrupt
from exogym.cluster.network import SERVER
from exogym.comm.transport import CollectiveError, MessageError

if TYPE_CHECKING:
    from exogym.backends.sim.events import CollectiveTransfer
    from exogym.backends.sim.protocols import Crossings, Messages

__all__ = ["Baton", "CollectiveCall", "Pending"]

_STALL_S = 2.0  # waiting on other processes this long with nothing to run, a process says so


@dataclass
class CollectiveCall:
    """One node's side of a collective: what it asked for and the tensors the result goes into."""

    op: str
    signature: tuple  # must be equal across members: op, shapes, dtypes, reduce op, src...
    args: dict[str, Any]
    step: int | None = None
    blocking: bool = True  # False: async_op=True, the node runs on and waits on a handle later
    match_step: bool = True  # False: the strategy meets at different steps on purpose (collectives_match_steps)

    def describe(self) -> str:
        return f"{self.op}{self.signature[1:]}"


@dataclass
class Pending:
    """One collective on its way: the calls so far, who is blocked on it, whether it has completed."""

    group: tuple[int, ...]
    seq: int
    calls: dict[int, CollectiveCall] = field(default_factory=dict)
    waiters: set[int] = field(default_factory=set)
    done: bool = False

    @property
    def key(self) -> tuple:
        return (self.group, self.seq)


class Baton:
    """Runs one function per node under the baton; `rendezvous` is the only place a node waits.

    local: the nodes this process runs (default: all num_nodes). With an `exchange`
    (exogym.backends.sim.exchange), collectives whose groups hold nodes of other processes cross to them once
    their local members have arrived, and the baton waits on the exchange when none of its nodes can run."""

    def __init__(self, num_nodes: int, *, on_resume: Callable[[int], None], on_pause: Callable[[int], None],
                 node_timeout: float | None = None, step_of: Callable[[int], int | None] = lambda rank: None,
                 local: Sequence[int] | None = None, exchange: "Crossings | None" = None,
                 on_stuck: Callable[[BaseException], None] | None = None,
                 clock_of: Callable[[int], float] = lambda rank: 0.0):
        self.num_nodes = num_nodes
        self.local = list(range(num_nodes)) if local is None else list(local)
        self._exchange = exchange
        self.node_timeout, self._step_of = node_timeout, step_of  # the watchdog's limit; a node's current step
        self._on_stuck = on_stuck  # the watchdog calls it before ending the process when a node stays stuck
        self._dog: Watchdog | None = None
        self._turn: int | str | None = None  # the node that ran last, or what the scheduler did since: an interrupt's note
        self.running: int | None = None  # the node holding the baton (None: the scheduler)
        self.arrivals = 0  # collectives entered so far, by any node: progress, for the watchdog
        self.turns, self.all_turns = [0] * num_nodes, 0  # turns given to each node and in all: progress (SpinWatch)
        self.waited_s = 0.0  # wall seconds every node here waited on other processes (the record's process_waited_s)
        self._on_resume, self._on_pause = on_resume, on_pause  # swap per-node state (RNG, grad mode)
        self._on_compute: Callable[[list[int]], None] | None = None  # what computes the parked nodes' work at once
        self._batched: tuple[int, ...] = ()  # the parked nodes while their batched step runs
        self._parked: list[int] = []  # nodes waiting at the compute rendezvous
        self._clock_of = clock_of  # a node's simulated clock now: where its run goes in the queue
        self.queue = EventQueue()  # the run's one event queue: the nodes' runs and the messages' events
        for r in self.local:
            self.queue.run(0.0, r)
        self._blocked: dict[int, tuple] = {}  # rank -> key of the collective it waits in
        self._pending: dict[tuple, Pending] = {}
        self._seq: dict[int, dict[tuple[int, ...], int]] = {r: {} for r in self.local}
        self._local_members: dict[tuple[int, ...], int] = {}  # group -> how many of its members run here
        self._across: dict[tuple, Pending] = {}  # collectives gone to other processes, by key
        self.crossings_started: dict[tuple[int, ...], int] = {}  # group -> collectives on it sent across so far
        self._finished: set[int] = set()
        self._scheduler: greenlet.greenlet | None = None
        self.messages: "Messages | None" = None  # point-to-point messages on the simulated clock (set by the backend)
        self._receiving: dict[int, str] = {}  # rank -> the message it waits for

    def run(self, node_fns: list[Callable[[], Any]]) -> list[Any]:
        """Run node_fns[i] as node local[i]; return their results in that order, or raise the first exception a
        node raises (a NodeTimeoutError when the watchdog stopped a node; a KeyboardInterrupt noting which node
        ran, and at which step, when the run was interrupted)."""
        dog = self._dog = Watchdog(self.node_timeout, self._progress, on_stuck=self._on_stuck)
        try:
            with dog:
                try:
                    results = self._run(node_fns)
                except WatchdogInterrupt:
                    dog.delivered = True
                    raise
        except WatchdogInterrupt:
            error = dog.error
            waiting = self._describe_waiting()
            if waiting:
                error.args = (f"{error.args[0]}\nThe others:\n{waiting}",)
            try:
                dog.raise_deferred()  # a Ctrl-C that came while the nodes unwound: the user still wants out
            except BaseException as interrupt:
                who = ("the server" if error.rank == SERVER else
                       f"node {error.rank} at step {error.step}")
                interrupt.add_note(f"(interrupted while the watchdog stopped {who}: it had run past node_timeout; "
                                   "see the error above)")
                raise interrupt from error
            raise error from None
        dog.raise_deferred()  # a Ctrl-C held back while a node caught the watchdog's interrupt and carried on
        return results

    def _interrupted_note(self) -> str:
        """Where a KeyboardInterrupt found the run: the node that ran, its step, and whether it ran past the timeout."""
        if self._turn is None:
            return "(interrupted before any node ran)"
        if isinstance(self._turn, str):
            return f"(interrupted while {self._turn})"
        step = self._step_of(self._turn)
        at = f"at step {step}" if step is not None else "before its first step"
        note = f"(interrupted while node {self._turn} ran, {at}"
        if self._dog is not None and self._dog.error is not None and self._dog.error.rank == self._turn:
            note += f"; it had run past node_timeout={self._dog.timeout:g} s and the watchdog was stopping it"
        return note + ")"

    def _progress(self) -> tuple:
        """What the watchdog samples (from its thread): who runs, how many collectives so far, its step, and the
        nodes of the batched step that runs (fused execution; None: a node's own turn): the first of them stands
        for the batch. While the scheduler runs the server's handler: SERVER and (the server's class, the message it
        handles)."""
        rank, batched = self.running, self._batched
        if rank is None and batched:
            return batched[0], self.arrivals, self._step_of(batched[0]), batched
        handling = getattr(self.messages, "handling", None) if rank is None else None
        if handling is not None:
            return SERVER, self.arrivals, handling, None
        return rank, self.arrivals, None if rank is None else self._step_of(rank), None

    def _run(self, node_fns: list[Callable[[], Any]]) -> list[Any]:
        results: dict[int, Any] = {}
        self._scheduler = greenlet.getcurrent()

        def body(rank: int, fn: Callable[[], Any]) -> None:
            results[rank] = fn()
            self._finish(rank)

        nodes = {r: greenlet.greenlet(lambda r=r, fn=fn: body(r, fn)) for r, fn in zip(self.local, node_fns)}
        crossing = self._exchange is not None
        post, queue = self.messages, self.queue
        try:
            while (queue.has_runs() or self._parked or post is not None and post.busy()
                   or crossing and self._exchange.busy):
                if not queue.next_is_run():
                    if self._parked and not queue.has_runs():  # the parked nodes' batched step, then they run on
                        parked, self._parked = self._parked, []
                        self._turn = f"computing the batched step of nodes {parked}"
                        self._batched = tuple(parked)  # watched: each parked node's step lasts the batched step
                        self._on_compute(parked)  # (one that raised stays named in describe_waiting)
                        self._batched = ()
                        for r in sorted(parked):
                            self._may_run(r)
                        continue
                    if post is not None and post.due():  # the next event in simulated time
                        self._turn = "delivering a message"
                        post.next_event()
                        continue
                    if not queue.has_runs():  # every node here waits on other processes
                        self._turn = "this process's nodes waited for nodes in other processes"
                        self._wait_for_other_processes()
                        continue
                    # (the keeper: its next event waits for the other processes, and its own nodes run first)
                if crossing and self._exchange.has_news():  # packets that came while the nodes ran (a proxy's answers,
                    self._exchange.wait(timeout=0)  # exogym.backends.sim.postproxy): in, between turns
                    continue  # (they may queue an earlier run)
                rank = queue.pop_run()
                self._on_resume(rank)
                self.running = self._turn = rank
                self.turns[rank] += 1
                self.all_turns += 1
                try:
                    nodes[rank].switch()  # returns when the node waits in a collective or finishes
                finally:
                    self.running = None
                    self._on_pause(rank)
            if self._receiving:
                raise MessageError("deadlock: no message will ever arrive for the nodes waiting in recv (every "
                                   "other node is finished or waits itself, and nothing is in flight):\n"
                                   + self._describe_waiting())
            if self._blocked:
                raise CollectiveError("deadlock: every unfinished node waits in a collective that cannot "
                                      "complete:\n" + self._describe_waiting())
            if crossing:
                if post is not None:
                    post.finish()
                self._exchange.report_finished()
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                e.add_note(self._interrupted_note())
            for g in nodes.values():  # unwind the others so their `finally` blocks run now, not at garbage collection
                if g and not g.dead:
                    g.throw(greenlet.GreenletExit)
            raise
        return [results[r] for r in self.local]

    def _wait_for_other_processes(self) -> None:
        """Wait for crossings to complete; when nothing moves anywhere, a deadlock across processes is an error."""
        since, stalled = time.monotonic(), False  # real time: a wait may take in many packets before its nodes run
        post = self.messages
        # (a keeper also waits while other processes run: until one of its nodes can run, an event is due, or nothing
        # is left to wait for)
        while not self.queue.has_runs() and (self._exchange.busy or post is not None and post.busy()):
            if post is not None:
                post.report_idle()  # a proxy tells the keeper it has nothing to run (exogym.backends.sim.postlink)
                if post.due():  # the keeper: the run is quiescent, the next event happens
                    break
            self._exchange.wait(timeout=0.25)  # completed crossings let their waiting members run
            if self.queue.has_runs():
                break
            self._exchange.check_peers()  # a process that stopped responding is named within peer_timeout
            if time.monotonic() - since >= _STALL_S:
                stalled = True
                progress = self.arrivals + self._exchange.completed + (0 if post is None else post.progress)
                everyone = self._exchange.report_stall(self._describe_waiting(), progress,
                                                       None if post is None else post.packets())
                if everyone is not None:
                    raise CollectiveError("deadlock across processes: every unfinished node waits in a collective "
                                          "that cannot complete:\n" + everyone)
        if stalled:
            self._exchange.report_running()
        self.waited_s += time.monotonic() - since

    def _finish(self, rank: int) -> None:
        self._finished.add(rank)
        for p in self._pending.values():
            if rank in p.group and rank not in p.calls:
                raise CollectiveError(
                    f"node {rank} finished while node(s) {sorted(p.calls)} wait for it in a collective on group "
                    f"{list(p.group)}:\n" + self._describe(p))

    def _yield(self, rank: int) -> None:
        """Let the scheduler run the next ready node; returns when this node is resumed."""
        queue = self.queue
        if queue.next_is_run() and queue.first_run() == rank:
            queue.pop_run()  # next in line anyway: keep running, no switch
            return
        self._scheduler.switch()

    def rendezvous(self, rank: int, group: tuple[int, ...], call: CollectiveCall,
                   complete: Callable[[list[CollectiveCall]], "CollectiveTransfer | None"],
                   arrive: Callable[[Pending], None] | None = None,
                   leave_across: Callable[[list[CollectiveCall], float], "CollectiveTransfer | None"] | None = None
                   ) -> Pending:
        """Arrive at the next collective on `group`. A blocking call returns once every member has arrived
        and the collective is computed; a non-blocking one returns at once (wait on it with `wait`).

        Calls on one group are matched by order, as torch.distributed does: each node's n-th call on a
        group meets the other members' n-th call on it. They must also have been issued at the same step
        (an async call counts at the step it was issued, not the one that waits on it): a node that skipped
        or repeated a collective would otherwise be paired with another step's call, silently.

        `complete(calls)` computes the collective and, unless its transfer shares the links with others, sets the
        members' clocks; a transfer it returns runs as a flow in the run's queue (exogym.backends.sim.postoffice), and
        the members wait until it ends. A group holding nodes of other processes: once its local members have
        arrived, the exchange takes it across; `leave_across(local calls, start)` then sets their clocks from the last
        arrival anywhere, or returns a transfer that runs as a flow (the keeper's), as `complete` does.
        """
        self.arrivals += 1
        seq = self._seq[rank].get(group, 0)
        self._seq[rank][group] = seq + 1
        gone = self._finished.intersection(group)
        if gone:
            raise CollectiveError(f"node {rank} (step {call.step}) called {call.describe()} on group {list(group)}, "
                                  f"but node(s) {sorted(gone)} already finished training")
        pending = self._pending.setdefault((group, seq), Pending(group, seq))
        if pending.calls:
            first_rank, first = next(iter(pending.calls.items()))
            if first.signature != call.signature:
                raise CollectiveError(
                    f"mismatched collective #{seq} on group {list(group)}: node {first_rank} (step {first.step}) "
                    f"called {first.describe()}, node {rank} (step {call.step}) called {call.describe()}")
            if first.step != call.step and first.match_step and call.match_step:
                raise CollectiveError(
                    f"collective #{seq} on group {list(group)} paired calls from different steps: node {first_rank} "
                    f"called {first.describe()} at step {first.step}, node {rank} called {call.describe()} at step "
                    f"{call.step}; every member must make the same collectives at the same step (one of them "
                    "skipped or repeated a call). A strategy whose nodes meet at different steps on purpose sets "
                    "the class attribute collectives_match_steps = False")
        pending.calls[rank] = call
        if arrive is not None:  # e.g. fold this member's tensor into the reduction now (exogym.backends.sim.transport)
            arrive(pending)
        if len(pending.calls) < self._members_here(group):
            if call.blocking:
                self.wait(rank, pending)
            return pending
        del self._pending[pending.key]
        if len(pending.calls) < len(group):  # members in other processes: across, then they run on
            self._across[pending.key] = pending
            self.crossings_started[group] = pending.seq + 1  # a group's crossings start in order: its count
            self._exchange.start(pending, [pending.calls[r] for r in sorted(pending.calls)], call.op,
                                 finish=lambda calls, start: self._crossed(pending, calls, start, leave_across))
            if call.blocking:
                self.wait(rank, pending)
            return pending
        transfer = complete([pending.calls[r] for r in group])
        if transfer is not None:  # its transfer shares the links: the members wait until its flow ends
            self._transfer(pending, transfer)
            if call.blocking:
                self.wait(rank, pending)
            return pending
        # Those blocked on it and the arriving node may run, each from its clock (equal clocks in rank order). Any
        # order gives the same numbers: a node's work depends only on its data, its RNG stream (swapped with the
        # baton), collective results (computed in rank order) and what it observes, which depends on simulated time
        # only (exogym.backends.sim.postoffice).
        self._release(pending, also=rank)
        self._yield(rank)
        return pending

    def _members_here(self, group: tuple[int, ...]) -> int:
        n = self._local_members.get(group)
        if n is None:
            local = set(self.local)
            n = self._local_members[group] = sum(r in local for r in group)
        return n

    def _transfer(self, pending: Pending, transfer: "CollectiveTransfer") -> None:
        """`pending` computed, its transfer shares the links: a flow of the post office's (over processes, the
        keeper's), whose end lets its members run on."""
        transfer.name = pending.key
        transfer.done = lambda: self._release(pending)  # its members' clocks are set: they run on, each from its clock
        self.messages.transfer(transfer)

    def _release(self, pending: Pending, also: int | None = None) -> None:
        """`pending` is done: its waiting members (and `also`, the node that completed it) may run."""
        pending.done = True
        for r in pending.waiters:
            del self._blocked[r]
        for r in sorted(pending.waiters if also is None else pending.waiters | {also}):
            self._may_run(r)

    def _crossed(self, pending: Pending, calls: list[CollectiveCall], start: float,
                 leave_across: Callable[[list[CollectiveCall], float], "CollectiveTransfer | None"] | None) -> None:
        """A crossing completed (its results are in the local members' tensors): they run on, each from its clock (on
        shared links, once its transfer's flow has ended at the keeper)."""
        transfer = leave_across(calls, start) if leave_across is not None else None
        del self._across[pending.key]
        if transfer is not None:
            self._transfer(pending, transfer)
            return
        self._release(pending)

    # ---- point-to-point messages (the post office calls these) ------------------------------------
    @property
    def open_crossings(self) -> list[tuple]:
        """The collectives sent across to other processes and not yet completed here, by (group, sequence)."""
        return list(self._across)

    def least_arrival_across(self) -> float:
        """The least arrival of this process's members in a collective across processes not yet completed here (inf:
        none): its transfer (shared links) starts at or after it, though an async member's clock has run on."""
        if not self._across:
            return math.inf
        return min(c.args["arrival"] for p in self._across.values() for c in p.calls.values())

    def collectives_made(self, rank: int, group: tuple[int, ...]) -> int:
        """How many collectives node `rank` has entered on `group`."""
        return self._seq[rank].get(group, 0)

    def describe_waiting(self) -> str:
        """What every node of this process waits for, one line each."""
        return self._describe_waiting()

    def floor(self) -> float:
        """The least simulated time a collective of this process's nodes can still start at: the least clock among
        its unfinished nodes, and the least arrival in a collective not yet completed here (a node may have run on
        past an async one); inf once all finished."""
        times = [self._clock_of(r) for r in self.local if r not in self._finished]
        for p in (*self._pending.values(), *self._across.values()):
            times.extend(c.args["arrival"] for c in p.calls.values())
        return min(times, default=math.inf)

    def is_finished(self, rank: int) -> bool:
        """Whether node `rank` has finished training."""
        return rank in self._finished

    def _may_run(self, rank: int) -> None:
        self.queue.run(self._clock_of(rank), rank)

    @property
    def parked(self) -> bool:
        """Whether some node waits at the compute rendezvous (fused execution)."""
        return bool(self._parked)

    def sleep(self, rank: int) -> None:
        """Hand the baton back until the post office wakes `rank` (its observation's turn in simulated time)."""
        self._scheduler.switch()

    def wake(self, rank: int) -> None:
        """`rank` may run again (its observation's turn came)."""
        self._may_run(rank)

    def await_message(self, rank: int, what: str) -> None:
        """Block `rank` until a message it can take arrives (wake_receiver)."""
        self._receiving[rank] = what
        self._scheduler.switch()

    def wake_receiver(self, rank: int) -> None:
        del self._receiving[rank]
        self._may_run(rank)

    def park(self, rank: int, compute: Callable[[list[int]], None]) -> None:
        """The compute rendezvous (fused execution): wait until no node can run any more, when
        compute(parked ranks) does every parked node's work in one batched step (every node of a run parks with the
        same one). No bytes, no simulated time; it cannot deadlock, since it completes whenever the others are
        blocked or parked too."""
        self._on_compute = compute
        self._parked.append(rank)
        self._scheduler.switch()

    def wait(self, rank: int, pending: Pending) -> None:
        """Block node `rank` until `pending` has completed (returns at once if it has)."""
        if pending.done:
            return
        pending.waiters.add(rank)
        self._blocked[rank] = pending.key
        self._scheduler.switch()  # resumed by the scheduler once the last member has completed the collective

    def _describe(self, p: Pending) -> str:
        return "\n".join(f"  node {r} (step {c.step}): {c.describe()} #{p.seq} on group {list(p.group)}"
                         + ("" if c.blocking or r in p.waiters else " (async, not waiting yet)")
                         for r, c in sorted(p.calls.items()))

    def _describe_waiting(self) -> str:
        lines = [self._describe(p) for p in self._pending.values()]
        lines += [self._describe(p) + f"\n    (sent across; waiting for nodes {sorted(set(p.group) - set(p.calls))} in "
                  "other processes)" for p in self._across.values()]
        lines += [f"  node {r}: waits in {what}" for r, what in sorted(self._receiving.items())]
        idle = sorted(set(self.local) - set(self._blocked) - set(self._receiving) - self._finished
                      - set(self._batched))
        if self._batched:
            lines.append(f"  in the batched step: nodes {list(self._batched)}")
        if self._finished:
            lines.append(f"  finished: nodes {sorted(self._finished)}")
        if idle:
            lines.append(f"  not waiting: nodes {idle}")
        return "\n".join(lines)
