"""The sim backend's watchdog: a node that keeps the baton too long is named, with its step and Python stack,
and stopped.

Sim nodes are greenlets of the caller's thread, so a node that loops without reaching a collective would hold
the baton forever and hang the run silently. A watchdog OS thread samples the scheduler's progress, a tuple
(running node, collectives entered so far, that node's step), every min(1 s, timeout / 10). The nodes pay
nothing for it: the scheduler already keeps those numbers (two attribute writes per baton hand-over or
collective), and the thread sleeps between samples. When the tuple has not changed for `timeout` seconds,
the node has run that long without finishing a step or entering a collective: the thread records the node's
Python stack (sys._current_frames: the running greenlet's frames) and raises an asynchronous exception in the
caller's thread (PyThreadState_SetAsyncExc), delivered at the node's next Python bytecode; the scheduler turns
it into a NodeTimeoutError. A node stuck inside native code (a C call that never returns) cannot be
interrupted that way: it is reported on stderr after a grace period, and stopped if it returns to Python.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import traceback
from typing import Callable

from exogym.backends.errors import NodeTimeoutError

__all__ = ["Watchdog", "WatchdogInterrupt"]

_NATIVE_GRACE_S = 5.0  # after the interrupt, how long before saying on stderr that the node is in native code


class WatchdogInterrupt(BaseException):
    """Raised inside the stuck node by the watchdog (a BaseException, so the node's `except Exception` blocks do
    not swallow it); the scheduler replaces it by the watchdog's NodeTimeoutError."""


class Watchdog:
    """Watches `progress()` (a hashable sample of the run's progress; element 0 is the running rank, element 2
    its step) from a thread; context manager around the scheduler's loop. timeout None: does nothing."""

    def __init__(self, timeout: float | None, progress: Callable[[], tuple]):
        self.timeout, self._progress = timeout, progress
        self.error: NodeTimeoutError | None = None
        self.delivered = False  # set by the scheduler once the interrupt arrived
        self._target = threading.get_ident()  # the thread the sim runs on: the caller's
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._active = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Watchdog":
        if self.timeout is not None:
            self._active = True
            self._thread = threading.Thread(target=self._watch, name="exogym-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._active = False
            if self.error is not None and not self.delivered:
                _set_async_exc(self._target, None)  # the node got free on its own: drop the undelivered interrupt
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 10)
        last, since = self._progress(), time.monotonic()
        while not self._stop.wait(period):
            sample = self._progress()
            if sample != last:
                last, since = sample, time.monotonic()
            elif time.monotonic() - since >= self.timeout and sample[0] is not None:
                self._fire(sample, time.monotonic() - since)
                break
        else:
            return
        if not self._stop.wait(_NATIVE_GRACE_S) and not self.delivered and self.error is not None:
            sys.stderr.write(f"exogym watchdog: {self.error}\n(the node is inside native code, which cannot be "
                             "interrupted; it is stopped when it returns to Python, or press Ctrl-C)\n")
            sys.stderr.flush()

    def _fire(self, sample: tuple, held_s: float) -> None:
        rank, step = sample[0], sample[2]
        frame = sys._current_frames().get(self._target)
        stack = "".join(traceback.format_stack(frame)[-25:]) if frame is not None else "  (not available)\n"
        where = f"in step {step} without finishing it" if step is not None else "before its first step"
        message = (f"node {rank} ran for {held_s:.1f} s {where} or reaching a collective, longer than "
                   f"node_timeout={self.timeout:g} s, so the run was stopped; it was here:\n{stack.rstrip()}\n"
                   "A node that loops or waits without reaching a collective holds the others up forever. If its "
                   "steps really take this long, pass fit(node_timeout=<seconds>) or node_timeout=None.")
        with self._lock:
            if not self._active:
                return
            self.error = NodeTimeoutError(message, rank, step)
            _set_async_exc(self._target, WatchdogInterrupt)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `thread_id` at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)
