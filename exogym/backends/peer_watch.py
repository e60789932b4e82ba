"""Whether the run's other processes still respond: each process beats in the run's store once a second (a thread of
its own, so a long step does not stop it), and a process waiting on another reads the beats. A process whose beat has
not changed for `timeout` seconds (fit's peer_timeout, DEFAULT_PEER_TIMEOUT by default) is stopped, hung, or cut off
from the store by a partition: the waiting process raises a PeerLostError naming it, instead of waiting for ever. A
process that finished says so and is not watched any more.

The beat is BEAT_S; a peer timeout is at least MIN_PEER_TIMEOUT (five beats), so that a beat or two delayed by a
loaded machine never counts as a lost process."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from exogym.backends.errors import PeerLostError, describe_process

__all__ = ["PeerWatch", "BEAT_S", "STARTUP_S", "DEFAULT_PEER_TIMEOUT", "MIN_PEER_TIMEOUT"]

BEAT_S = 1.0  # how often a process beats
DEFAULT_PEER_TIMEOUT = 30.0  # fit's peer_timeout: seconds without a beat before a process counts as lost
MIN_PEER_TIMEOUT = 5 * BEAT_S  # the shortest peer_timeout fit takes: five beats
STARTUP_S = 60.0  # the least a process that never beat is given before it counts as lost
_FINISHED = b"finished"


class PeerWatch:
    """This process's beat, and what it knows of the others'.

    Args:
        store: a client of the run's store.
        key: the run's prefix in it.
        me: this process.
        owner: the process of each node, by rank.
        timeout: seconds without a beat before a process counts as lost (fit's peer_timeout; None: never).
    """

    def __init__(self, store: Any, key: str, me: int, owner: Sequence[int], timeout: float | None):
        self.store, self.key, self.me, self.owner, self.timeout = store, key, me, list(owner), timeout
        self.processes = max(self.owner) + 1
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # process -> (its last beat, when it changed here)
        self._checked = 0.0
        self._stop = threading.Event()
        self._count = 0
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="exogym-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._count += 1
        self.store.set(f"{self.key}/beat/{self.me}", str(self._count))

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the run is ending
                return

    def finished(self) -> None:
        """This process ran all its nodes: the others stop watching it."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.store.set(f"{self.key}/beat/{self.me}", _FINISHED.decode())

    def close(self) -> None:
        """Stop beating (the run stopped here), and wait for the beat in flight: a thread still inside a store call
        when the store is destroyed at exit can abort the process."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def nodes_of(self, process: int) -> tuple[int, ...]:
        return tuple(r for r, p in enumerate(self.owner) if p == process)

    def _beats(self) -> dict[int, bytes | None]:
        out = {}
        for p in range(self.processes):
            key = f"{self.key}/beat/{p}"
            out[p] = self.store.get(key) if p != self.me and self.store.check([key]) else None
        return out

    def silent(self, over_s: float = 2.5 * BEAT_S) -> list[int]:
        """The other processes whose beat does not move over `over_s` seconds (and did not finish): those gone."""
        first = self._beats()
        time.sleep(over_s)
        second = self._beats()
        return [p for p in range(self.processes)
                if p != self.me and second[p] != _FINISHED and second[p] == first[p]]

    def lost(self, process: int, cause: BaseException, how: str | None = None) -> PeerLostError:
        """The error naming `process` as gone, from the error this process saw (`cause`); `how` says how this
        process learnt it (default: a message from it failed)."""
        what = describe_process(process, self.nodes_of(process))
        how = how or f"a message from it failed ({cause})"
        return PeerLostError(f"{what} went away: {how}; it died, or its machine or the link to it did", process,
                             self.nodes_of(process))

    def check(self) -> None:
        """Raise PeerLostError for a process whose beat has not changed for `timeout` seconds (checked at most once
        a second)."""
        now = time.monotonic()
        if self.timeout is None or now - self._checked < BEAT_S:
            return
        self._checked = now
        for p in range(self.processes):
            if p == self.me:
                continue
            beat = self.store.get(f"{self.key}/beat/{p}") if self.store.check([f"{self.key}/beat/{p}"]) else None
            if beat == _FINISHED:
                continue
            last, since = self._seen.get(p, (None, now))
            # A process yet to beat may still be starting (loading its data or a checkpoint under load): it has
            # STARTUP_S at least before it counts as lost.
            limit = self.timeout if beat is not None else max(self.timeout, STARTUP_S)
            if beat != last or p not in self._seen:
                self._seen[p] = (beat, now)
            elif now - since >= limit:
                what = describe_process(p, self.nodes_of(p))
                raise PeerLostError(f"{what} stopped responding: no heartbeat for {now - since:.0f} s (fit's "
                                    f"peer_timeout={self.timeout:g}); it is stopped, hung, or cut off by a network "
                                    f"partition. Noticed by {describe_process(self.me, self.nodes_of(self.me))}, "
                                    "which waited for it", p, self.nodes_of(p))

