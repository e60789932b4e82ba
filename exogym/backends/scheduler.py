"""The baton: K node threads in one process, exactly one running at a time.

A node runs until it enters a collective, then hands the baton on. When the last member of
a group arrives, the collective is computed once (by that thread, in rank order) and every
member becomes runnable again, queued in rank order. Because only the baton holder runs,
all state here is touched by one thread at a time and needs no lock; the per-node Events
carry the happens-before edge from one holder to the next.

Nothing can hang silently: the scheduler sees every node, so a collective that cannot
complete (mismatched calls, a member that finished or waits elsewhere) is an error the
moment it becomes certain, naming the nodes, their steps and their calls.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from exogym.comm import CollectiveError

__all__ = ["Scheduler", "CollectiveCall"]


class _Aborted(BaseException):
    """Unwinds a waiting node thread after another node failed."""


@dataclass
class CollectiveCall:
    """One node's side of a collective: what it asked for and the tensors the result goes into."""

    op: str
    signature: tuple  # must be equal across members: op, shapes, dtypes, reduce op, src...
    args: dict[str, Any]
    step: int | None = None

    def describe(self) -> str:
        return f"{self.op}{self.signature[1:]}"


@dataclass
class _Pending:
    group: tuple[int, ...]
    seq: int
    calls: dict[int, CollectiveCall] = field(default_factory=dict)


class Scheduler:
    """Runs one function per node under the baton; `rendezvous` is the only blocking point."""

    def __init__(self, num_nodes: int, *, on_resume: Callable[[int], None], on_pause: Callable[[int], None]):
        self.num_nodes = num_nodes
        self._on_resume, self._on_pause = on_resume, on_pause  # swap per-node state (RNG) with the baton
        self._events = [threading.Event() for _ in range(num_nodes)]
        self._ready: deque[int] = deque(range(num_nodes))
        self._blocked: dict[int, tuple] = {}  # rank -> key of the collective it waits in
        self._pending: dict[tuple, _Pending] = {}
        self._seq: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_nodes)]
        self._finished: set[int] = set()
        self._failure: tuple[int, BaseException] | None = None
        self._done = threading.Event()

    # ---- running ----------------------------------------------------------------------------
    def run(self, node_fns: list[Callable[[], Any]], *, thread_name: str = "exogym-node") -> list[Any]:
        """Run node_fns[r] as node r; return their results, or raise the first node's exception."""
        results: list[Any] = [None] * self.num_nodes
        threads = [threading.Thread(target=self._body, args=(r, fn, results), name=f"{thread_name}-{r}", daemon=True)
                   for r, fn in enumerate(node_fns)]
        for t in threads:
            t.start()
        self._pass_baton()
        try:
            while not self._done.wait(0.2):  # short waits keep Ctrl-C responsive
                pass
        except BaseException as e:
            self._fail(-1, e)
        for t in threads:
            t.join(timeout=10.0)
        if self._failure is not None:
            raise self._failure[1]
        return results

    def _body(self, rank: int, fn: Callable[[], Any], results: list[Any]) -> None:
        try:
            self._wait_turn(rank)
            results[rank] = fn()
            self._finish(rank)
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - everything a node raises ends the run
            self._fail(rank, e)

    def _wait_turn(self, rank: int) -> None:
        event = self._events[rank]
        while not event.wait(1.0):
            if self._failure is not None:
                raise _Aborted
        event.clear()
        if self._failure is not None:
            raise _Aborted
        self._on_resume(rank)

    def _pass_baton(self) -> bool:
        """Wake the next runnable node; False if there is none."""
        if not self._ready:
            return False
        self._events[self._ready.popleft()].set()
        return True

    def _yield(self, rank: int) -> None:
        """Give up the baton and sleep until it comes back."""
        if self._ready and self._ready[0] == rank:
            self._ready.popleft()  # next in line anyway: keep running, no switch
            return
        if not self._ready:
            raise CollectiveError("deadlock: every unfinished node waits in a collective that cannot complete:\n"
                                  + self._describe_waiting())
        self._on_pause(rank)
        self._pass_baton()
        self._wait_turn(rank)

    def _fail(self, rank: int, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = (rank, exc)
        for e in self._events:
            e.set()
        self._done.set()

    def _finish(self, rank: int) -> None:
        self._finished.add(rank)
        for p in self._pending.values():
            if rank in p.group:
                raise CollectiveError(
                    f"node {rank} finished while node(s) {sorted(p.calls)} wait for it in a collective on group "
                    f"{list(p.group)}:\n" + self._describe(p))
        if self._pass_baton():
            return
        if self._blocked:
            raise CollectiveError("deadlock: every unfinished node waits in a collective that cannot complete:\n"
                                  + self._describe_waiting())
        self._done.set()

    # ---- collectives ------------------------------------------------------------------------
    def rendezvous(self, rank: int, group: tuple[int, ...], call: CollectiveCall,
                   complete: Callable[[list[CollectiveCall]], None]) -> None:
        """Arrive at the next collective on `group`; return once every member has arrived and it is computed.

        Calls on one group are matched by order, as torch.distributed does: each node's n-th call on a
        group meets the other members' n-th call on it.
        """
        seq = self._seq[rank].get(group, 0)
        self._seq[rank][group] = seq + 1
        key = (group, seq)
        gone = self._finished.intersection(group)
        if gone:
            raise CollectiveError(f"node {rank} (step {call.step}) called {call.describe()} on group {list(group)}, "
                                  f"but node(s) {sorted(gone)} already finished training")
        pending = self._pending.setdefault(key, _Pending(group, seq))
        if pending.calls:
            first_rank, first = next(iter(pending.calls.items()))
            if first.signature != call.signature:
                raise CollectiveError(
                    f"mismatched collective #{seq} on group {list(group)}: node {first_rank} (step {first.step}) "
                    f"called {first.describe()}, node {rank} (step {call.step}) called {call.describe()}")
        pending.calls[rank] = call
        if len(pending.calls) < len(group):
            self._blocked[rank] = key
            self._yield(rank)
            return
        del self._pending[key]
        complete([pending.calls[r] for r in group])
        others = [r for r in group if r != rank]
        for r in others:
            del self._blocked[r]
        # Members resume in rank order, after nodes already queued (who are still before their own
        # collective). Any fixed order gives the same numbers: each node's work depends only on its data,
        # its RNG stream (swapped with the baton) and collective results (computed in rank order).
        self._ready.extend(group)
        self._yield(rank)

    # ---- error text -------------------------------------------------------------------------
    def _describe(self, p: _Pending) -> str:
        return "\n".join(f"  node {r} (step {c.step}): {c.describe()} #{p.seq} on group {list(p.group)}"
                         for r, c in sorted(p.calls.items()))

    def _describe_waiting(self) -> str:
        lines = [self._describe(p) for p in self._pending.values()]
        missing = sorted(set(range(self.num_nodes)) - set(self._blocked) - self._finished)
        if self._finished:
            lines.append(f"  finished: nodes {sorted(self._finished)}")
        if missing:
            lines.append(f"  not waiting: nodes {missing}")
        return "\n".join(lines)
