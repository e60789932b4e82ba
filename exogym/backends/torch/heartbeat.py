"""The torch backend's answer to "who never came?" and "who called what?": each node's collectives, published
through the store.

A collective that times out on torch.distributed says only that this node waited; the node that never arrived is
elsewhere, in its own process. Members that call different collectives (another shape, dtype or op) are not named
at all: gloo aborts the process that receives more bytes than it expects (SIGABRT, "Received data size doesn't
match expected size") and the others fail with "Connection reset by peer", or they all wait until the timeout; a
mismatched call can even complete on one side, which then fails in its next call. So each node keeps a ledger of
the collectives it entered (how many per group; each group's recent calls: op, signature as the sim writes it,
step, number). A thread publishes it to the run's key-value store (the TCPStore the process group rendezvoused
through) when it changed, at most every min(1 s, timeout / 10); and as the node enters each collective, before
launching it, it publishes that call alone (a record of constant size, whatever the ledger holds), so that the call
is on record even if the collective then aborts its process. A collective pays one small JSON dump and one store
write (a write needs no reply: about 1 us here). When a collective fails, the node reads every member's ledger,
brought up to its last call: a member whose last call differs from this node's call with the same number is a mismatch, named
call by call as the sim names it; otherwise, on a timeout, the members that never entered that collective (fewer
calls on the group) are named, with the step they are at and the last collective they entered.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Callable, Sequence

__all__ = ["CollectiveLedger", "Heartbeat", "missing_members_report", "mismatch_report", "describe_call",
           "is_timeout"]

_RECENT = 16  # a node's own calls per group kept to compare with the members' (a mismatch is found a few calls on)
# Groups whose recent calls are kept: the latest used. A strategy that draws new groups every round (FedAvg's
# random islands) would otherwise grow the ledger, and so each publication, with every round.
_RECENT_GROUPS = 64


class CollectiveLedger:
    """The collectives one node entered: calls per group (ranks tuple -> count), the last call of all, and each
    group's recent calls [op, signature, step, number] (the last one is published; the older ones stay here, to
    compare with a member that stopped at one of them while this node went on: a mismatched collective can
    complete on one side)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], int] = {}
        self.last: tuple[str, tuple[int, ...], int | None, int] | None = None  # (op, group, step, its number)
        self.recent: dict[tuple[int, ...], deque[list]] = {}

    def enter(self, op: str, group: tuple[int, ...], step: int | None, signature: tuple = ()) -> int:
        """Note one call (`signature`: shapes, dtypes, reduce op or src, as the sim's); return its number on `group`
        (1 for the first)."""
        n = self.counts.get(group, 0) + 1
        self.counts[group] = n
        self.last = (op, group, step, n)
        calls = self.recent.pop(group, None) or deque(maxlen=_RECENT)  # re-inserted: the latest used come last
        calls.append([op, _plain(signature), step, n])
        self.recent[group] = calls
        if len(self.recent) > _RECENT_GROUPS:
            del self.recent[next(iter(self.recent))]
        return n

    def last_call(self) -> dict[str, Any] | None:
        """The call entered last, as published before each collective: its group and [op, signature, step, number]."""
        if self.last is None:
            return None
        group = self.last[1]
        return {"group": _key(group), "call": self.recent[group][-1]}

    def snapshot(self, step: int | None) -> dict[str, Any]:
        # Copied in one call each (atomic under the GIL): the heartbeat's thread reads while the node enters calls.
        counts, recent, last = list(self.counts.items()), list(self.recent.items()), self.last
        return {"step": step, "counts": {_key(g): n for g, n in counts},
                "last": None if last is None else list(last[:1]) + [list(last[1]), *last[2:]],
                "calls": {_key(g): calls[-1] for g, calls in recent},
                "time": time.time()}


def _key(group: tuple[int, ...]) -> str:
    return ",".join(map(str, group))


def _plain(signature: Any) -> Any:
    """The signature as it reads back from the store (tuples become lists), so that published ones compare equal."""
    return [_plain(v) for v in signature] if isinstance(signature, (list, tuple)) else signature


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def describe_call(op: str, signature: Any) -> str:
    """A call as the sim names it: all_reduce((3,), 'float32', 'sum')."""
    return f"{op}{_tuples(signature)}"


class Heartbeat:
    """Publishes node `rank`'s ledger (and its current step, from `step_of`) to `store` from a daemon thread, under
    key prefix/<rank>, at most every `period`; the node publishes each call it enters (`publish_call`, a record of
    constant size) under prefix/<rank>/call. `read` fetches the members' latest ledgers, with their last calls."""

    def __init__(self, store: Any, rank: int, ledger: CollectiveLedger, step_of: Callable[[], int | None],
                 timeout_s: float, prefix: str):
        self.store, self.rank, self.ledger, self.step_of = store, rank, ledger, step_of
        self.prefix, self.period = prefix, min(1.0, timeout_s / 10)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # publish() from the node's thread, _beat() from the heartbeat's
        self._published: tuple | None = None  # (step, last call) as last written
        self._thread = threading.Thread(target=self._beat, name=f"exogym-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self.publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def publish(self) -> bool:
        """Write the ledger and the step to the store now; False when the store is gone (the run is ending:
        nothing left to tell, and no reason to fail a collective)."""
        with self._lock:
            state = (self.step_of(), self.ledger.last)
            try:
                self.store.set(f"{self.prefix}/{self.rank}", json.dumps(self.ledger.snapshot(state[0])))
            except Exception:  # noqa: BLE001
                return False
            self._published = state
        return True

    def publish_call(self) -> bool:
        """Write the call just entered (the node calls it before launching each collective, which may abort this
        process); False when the store is gone."""
        try:
            self.store.set(f"{self.prefix}/{self.rank}/call", json.dumps(self.ledger.last_call()))
        except Exception:  # noqa: BLE001
            return False
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            if (self.step_of(), self.ledger.last) != self._published and not self.publish():
                return

    def read(self, ranks: tuple[int, ...]) -> dict[int, dict[str, Any] | None]:
        """Each rank's latest ledger, brought up to its last call (None where it never published: its process did
        not get that far)."""
        return {r: _with_last_call(self._get(f"{self.prefix}/{r}"), self._get(f"{self.prefix}/{r}/call"))
                for r in ranks}

    def _get(self, key: str) -> Any:
        try:
            return json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store went away: say what is known
            return None


def _with_last_call(ledger: dict[str, Any] | None, last: dict[str, Any] | None) -> dict[str, Any] | None:
    """A published ledger (at most a heartbeat period old) with the call published since: the group's count, the
    last call, and that group's latest call."""
    if not isinstance(last, dict):
        return ledger
    ledger = dict(ledger or {"step": None, "counts": {}, "calls": {}})
    group, (op, signature, step, number) = last["group"], last["call"]
    if number >= ledger.get("counts", {}).get(group, 0):
        ledger["counts"] = {**ledger.get("counts", {}), group: number}
        ledger["calls"] = {**ledger.get("calls", {}), group: last["call"]}
        ledger["last"] = [op, [int(r) for r in group.split(",")], step, number]
        if step is not None and (ledger.get("step") is None or step > ledger["step"]):
            ledger["step"] = step
    return ledger


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


def mismatch_report(rank: int, group: tuple[int, ...], own: Sequence[list],
                    ledgers: dict[int, dict[str, Any] | None]) -> str | None:
    """Node `rank`'s recent calls on `group` (`own`: [op, signature, step, number], CollectiveLedger.recent) against
    the last call each member published: where one differs from this node's call with the same number, the message
    naming every member's call with that number, as the sim's (the earliest such number); else None."""
    mine = {call[3]: call for call in own}
    theirs = {}
    for r in group:
        call = ((ledgers.get(r) or {}).get("calls") or {}).get(_key(group)) if r != rank else None
        if call is not None and call[3] in mine:
            theirs[r] = call
    differing = sorted(c[3] for c in theirs.values() if c[:2] != mine[c[3]][:2])
    if not differing:
        return None
    number = differing[0]
    calls = {rank: mine[number], **{r: c for r, c in theirs.items() if c[3] == number}}
    lines = [f"  node {r} (step {c[2]}): {describe_call(c[0], c[1])}" for r, c in sorted(calls.items())]
    unknown = sorted(set(group) - set(calls))
    if unknown:
        lines.append(f"  node(s) {unknown}: not known (their last call on this group has another number)")
    return "\n".join([f"mismatched collective #{number} on group {list(group)}: the members called different "
                      "collectives (every node must make the same collectives, with the same shapes and dtypes, in "
                      "the same order):", *lines])
