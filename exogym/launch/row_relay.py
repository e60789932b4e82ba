"""Rows across a torchrun job as they are flushed: every process but the main one posts its nodes' rows to the job's
key-value store (`StoreRelay`), and the main process, which holds the run folder and the loggers, reads them into its
live log while the run trains (`RelayReader`). So the run folder holds every step all nodes completed up to their
last flush, whichever process stops first, not only once the run ends.

Messages go under `<key>/<process>/<n>` with a counter `<key>/<process>/count`; the reader deletes what it has read.
"""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from typing import Any, Callable

__all__ = ["StoreRelay", "RelayReader", "LockedLive", "store_timeout"]

_POLL_S = 0.5  # how often the main process looks for the others' rows


class StoreRelay:
    """A non-main process's live log: its rows are kept here (the process's own record) and posted to the store.

    Args:
        live: this process's LiveLog (keeps the rows for the process's record of a run that stops part-way).
        store: a client of the job's store.
        key: this process's prefix in it (`<run key>/rows/<process>`).
    """

    def __init__(self, live: Any, store: Any, key: str):
        self.live, self.store, self.key = live, store, key
        self._sent = 0
        self._lock = threading.Lock()  # the sim's watchdog thread may flush a stuck node's rows

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None:
        self.live.add_rows(rank, rows)
        self._post(("rows", rank, rows))

    def add_row(self, table: str, row: dict[str, float]) -> None:
        self.live.add_row(table, row)
        self._post(("row", table, row))

    def _post(self, message: tuple) -> None:
        with self._lock:
            self.store.set(f"{self.key}/{self._sent}", pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            self._sent += 1
            self.store.set(f"{self.key}/count", str(self._sent))


class LockedLive:
    """The main process's live log, shared by its own nodes and the RelayReader's thread: one call at a time."""

    def __init__(self, live: Any, lock: threading.Lock):
        self.live, self.lock = live, lock

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None:
        with self.lock:
            self.live.add_rows(rank, rows)

    def add_row(self, table: str, row: dict[str, float]) -> None:
        with self.lock:
            self.live.add_row(table, row)


class RelayReader:
    """In the main process: a thread feeding `live` with the rows the other processes post, every _POLL_S.

    Args:
        live: the main process's LiveLog.
        connect: makes a client of the job's store for the thread (a client is not shared across threads).
        keys: the other processes' prefixes.
        lock: taken around each call into `live` (the main process's own nodes use it too, through LockedLive).
    """

    def __init__(self, live: Any, connect: Callable[[], Any], keys: list[str], lock: threading.Lock):
        self.live, self.connect, self.keys, self.lock = live, connect, keys, lock
        self._read = {k: 0 for k in keys}
        self._stop = threading.Event()
        self._store: Any = None
        self._thread = threading.Thread(target=self._loop, name="exogym-row-relay", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "RelayReader":
        self._thread.start()
        return self

    def _loop(self) -> None:
        try:
            self._store = self.connect()
            while not self._stop.wait(_POLL_S):
                self.drain(self._store)
        except BaseException as e:  # noqa: BLE001 - the store went away: the final drain says what is left
            self.error = e

    def drain(self, store: Any) -> None:
        """Read every message posted so far into the live log."""
        for key in self.keys:
            if not store.check([f"{key}/count"]):
                continue
            count = int(store.get(f"{key}/count"))
            while self._read[key] < count:
                n = self._read[key]
                kind, *payload = pickle.loads(store.get(f"{key}/{n}"))
                with self.lock:
                    (self.live.add_rows if kind == "rows" else self.live.add_row)(*payload)
                self._read[key] = n + 1
                store.delete_key(f"{key}/{n}")

    def stop(self, store: Any) -> None:
        """Stop the thread, then read what is left with `store` (the caller's client), if it still answers."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            return  # blocked on a store that no longer answers: what it read is in the live log
        try:
            self.drain(store)
        except Exception:  # noqa: BLE001 - the store is gone with its host: the rows read so far are kept
            pass


def store_timeout(timeout: timedelta, cap_s: float = 30.0) -> timedelta:
    """A store client's timeout for relaying rows: the group's, at most cap_s."""
    return min(timeout, timedelta(seconds=cap_s))
