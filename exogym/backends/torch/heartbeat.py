"""The torch backend's answer to "who never came?": each node's collectives, published through the store.

A collective that times out on torch.distributed says only that this node waited; the node that never arrived is
elsewhere, in its own process. So each node keeps a ledger of the collectives it entered (how many per group,
the last one) and its current step, and a thread publishes it to the run's key-value store (the TCPStore the
process group rendezvoused through) every min(1 s, timeout / 10), when it changed. The training loop pays one
dict update per collective; the thread sleeps in between. When a collective times out, the waiting node reads
every member's ledger and names the members that never entered that collective (fewer calls on the group), with
the step they are at and the last collective they entered.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any, Callable

__all__ = ["CollectiveLedger", "Heartbeat", "missing_members_report", "is_timeout"]


class CollectiveLedger:
    """The collectives one node entered: calls per group (ranks tuple -> count) and the last call."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], int] = {}
        self.last: tuple[str, tuple[int, ...], int | None, int] | None = None  # (op, group, step, its number)

    def enter(self, op: str, group: tuple[int, ...], step: int | None) -> int:
        """Note one call; return its number on `group` (1 for the first)."""
        n = self.counts.get(group, 0) + 1
        self.counts[group] = n
        self.last = (op, group, step, n)
        return n

    def snapshot(self, step: int | None) -> dict[str, Any]:
        return {"step": step, "counts": {_key(g): n for g, n in self.counts.items()},
                "last": None if self.last is None else list(self.last[:1]) + [list(self.last[1]), *self.last[2:]],
                "time": time.time()}


def _key(group: tuple[int, ...]) -> str:
    return ",".join(map(str, group))


class Heartbeat:
    """Publishes node `rank`'s ledger (and its current step, from `step_of`) to `store` from a daemon thread, under
    keys prefix/<rank>; `read` fetches the members' latest ledgers."""

    def __init__(self, store: Any, rank: int, ledger: CollectiveLedger, step_of: Callable[[], int | None],
                 timeout_s: float, prefix: str):
        self.store, self.rank, self.ledger, self.step_of = store, rank, ledger, step_of
        self.prefix, self.period = prefix, min(1.0, timeout_s / 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"exogym-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _publish(self) -> tuple:
        state = (self.step_of(), dict(self.ledger.counts), self.ledger.last)
        self.store.set(f"{self.prefix}/{self.rank}", json.dumps(self.ledger.snapshot(state[0])))
        return state

    def _beat(self) -> None:
        last = None
        while not self._stop.wait(self.period):
            state = (self.step_of(), dict(self.ledger.counts), self.ledger.last)
            if state != last:
                try:
                    last = self._publish()
                except Exception:  # noqa: BLE001 - the store is gone (the run is ending): nothing left to tell
                    return

    def read(self, ranks: tuple[int, ...]) -> dict[int, dict[str, Any] | None]:
        """Each rank's latest ledger (None where it never published: its process did not get that far)."""
        out: dict[int, dict[str, Any] | None] = {}
        for r in ranks:
            key = f"{self.prefix}/{r}"
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store went away: say what is known
                out[r] = None
        return out


def is_timeout(e: BaseException) -> bool:
    """Whether a torch.distributed error is a collective timing out (gloo: "Timed out waiting ...")."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def missing_members_report(rank: int, op: str, group: tuple[int, ...], number: int, step: int | None,
                           timeout: timedelta, ledgers: dict[int, dict[str, Any] | None]) -> tuple[str, list[int]]:
    """The message for node `rank`, which waited `timeout` in call `number` on `group` (op, at `step`), and the
    members that never entered that call."""
    missing, lines = [], []
    for r in group:
        if r == rank:
            continue
        ledger = ledgers.get(r)
        if ledger is None:
            missing.append(r)
            lines.append(f"  node {r}: no record (its process never got to its first step, or died)")
            continue
        calls = ledger["counts"].get(_key(group), 0)
        where = f"at step {ledger['step']}" if ledger["step"] is not None else "before its first step"
        last = ledger["last"]
        did = f"; its last collective: {last[0]} #{last[3]} on group {last[1]} at step {last[2]}" if last else \
            "; no collective yet"
        if calls < number:
            missing.append(r)
            lines.append(f"  node {r}: never reached it ({calls} call(s) on this group so far), {where}{did}")
        else:
            lines.append(f"  node {r}: reached it, {where}{did}")
    head = (f"node(s) {missing} never reached {op} #{number} on group {list(group)}, " if missing else
            f"every member reached {op} #{number} on group {list(group)}, yet it did not complete: ")
    head += (f"which node {rank} entered at step {step} and waited in for {timeout.total_seconds():g} s "
             "(fit's node_timeout); the run was stopped.")
    fix = ("A node that skips a collective, loops, or waits elsewhere holds the others up: every node must make "
           "the same collectives in the same order. If steps really take this long, raise fit(node_timeout=...).")
    return "\n".join([head, *lines, fix]), missing
