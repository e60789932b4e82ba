"""The sim backend's watchdog: a node that keeps the baton past node_timeout is named, with its step and Python
stack, and stopped; one that cannot be stopped ends the process (when the run asks for it) rather than hang it. The
same holds for a strategy's server, whose handlers run on the keeper between the nodes' turns: one handler (receive,
wake) running past node_timeout is a ServerTimeoutError naming the server and the message it was handling.

Sim nodes are greenlets of the caller's thread, so a node that loops or waits without reaching a collective would
hold the baton forever and hang the run silently. A watchdog OS thread samples the scheduler's progress, a tuple
(running node, collectives entered so far, that node's step), every min(1 s, timeout / 10). The nodes pay nothing
for it: the scheduler already keeps those numbers, and the thread sleeps between samples. When the tuple has not
changed for `timeout` seconds, not counting the time the node spent importing a torch module (torch imports some of
its own on first use: torch._dynamo with a node's first optimizer, seconds on a loaded machine; importing_torch), the
thread records the node's Python stack (sys._current_frames: the running greenlet's frames) and stops the node with
a WatchdogInterrupt, which the scheduler turns into a NodeTimeoutError:

- On the main thread (the usual case), the run installs, for its duration only, a handler for KICK_SIGNAL (SIGURG:
  ignored by default and unused by Python programs, so a stray one changes nothing), and the watchdog sends it to
  the sim's thread (signal.pthread_kill). The handler raises the interrupt. The signal also ends the system call
  the node waits in (EINTR), and as the handler raised, CPython does not retry the call (PEP 475). Measured here
  (Linux, CPython 3.11): time.sleep, threading.Event.wait and Lock.acquire (with or without a timeout),
  queue.Queue.get, Thread.join, select.select, socket.recv, os.read on a pipe, subprocess.Popen.wait,
  subprocess.run and libc's sleep and pause called through ctypes all end within milliseconds; a Python loop
  stops at its next bytecode.
- On another thread (signal handlers run on the main thread only) or without pthread_kill (Windows), only Python
  code can be stopped: an asynchronous exception (PyThreadState_SetAsyncExc), delivered at the next bytecode.

What neither reaches: native code that retries its wait after a signal (measured: torch.futures.Future.wait, a
C++ wait), a C loop, or any native wait off the main thread. Such a node gets a grace period of max(5 s,
timeout / 2). If by then the run has not stopped and the node has not moved on (one whose code caught the
interrupt and carried on is told so on stderr, and not watched again), the watchdog writes the NodeTimeoutError
on stderr and, when the run gave `on_stuck` (fit does: it records the failure in the run folder), calls
on_stuck(error) (for at most 30 s) and ends the process with os._exit(STUCK_EXIT_CODE) (124, GNU timeout's "timed
out"): the stuck call cannot be unwound, and waiting on would hang the run forever. Without on_stuck (run_sim or a
Baton called directly: a notebook, a test) the process is left running, with the message on stderr saying how to
end it: a library ends its caller's process only when the caller asked for it. Native code that holds the GIL
while it hangs freezes every Python thread, the watchdog's included; nothing in the process can name it then.

Ctrl-C raises KeyboardInterrupt in the node that runs (the scheduler's note names it and its step). Two exceptions
raised into one wait break it (the second lands in the wait's cleanup: "RuntimeError: release unlocked lock"), so
while the handler is installed the run also wraps the Python handlers of SIGINT and SIGTERM, and at most one of
them and the watchdog raises: an interrupt that raised first silences the watchdog, and an interrupt that arrives
while the watchdog's interrupt unwinds the nodes is deferred (`raise_deferred`) until they have unwound (a second
one goes through at once).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch

from exogym.backends.errors import STUCK_EXIT_CODE, NodeTimeoutError, ServerTimeoutError
from exogym.cluster.network import SERVER

__all__ = ["Watchdog", "WatchdogInterrupt", "KICK_SIGNAL", "STUCK_EXIT_CODE", "stuck_grace", "importing_torch",
           "SpinWatch"]

KICK_SIGNAL: int | None = getattr(signal, "SIGURG", None)  # sent to the sim's thread to stop the node
_ON_STUCK_S = 30.0  # how long on_stuck may take (it writes the run folder) before the process exits anyway
_INTERRUPTS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM") if hasattr(signal, name))


def stuck_grace(timeout: float) -> float:
    """After the watchdog fired, how long the node has to stop before it counts as stuck in native code."""
    return max(5.0, timeout / 2)


class WatchdogInterrupt(BaseException):
    """Raised inside the stuck node by the watchdog (a BaseException, so the node's `except Exception` blocks do
    not swallow it); the scheduler replaces it by the watchdog's NodeTimeoutError."""


class Watchdog:
    """Watches `progress()` (a hashable sample of the run's progress; element 0 is the running rank, element 2
    its step, element 3 the nodes of a fused batched step or None) from a thread; context manager around the
    scheduler's loop. timeout None: does nothing. A batched step is every parked node's step at once, so it gets
    node_timeout, as each of those steps would.

    on_stuck(error): called (from the watchdog's thread) when the node has not stopped `grace` seconds after the
    watchdog fired; the process then exits with STUCK_EXIT_CODE. None: the message goes to stderr, nothing more."""

    def __init__(self, timeout: float | None, progress: Callable[[], tuple], *,
                 on_stuck: Callable[[BaseException], None] | None = None, grace: float | None = None):
        self.timeout, self._progress, self._on_stuck = timeout, progress, on_stuck
        self.grace = grace if grace is not None or timeout is None else stuck_grace(timeout)
        self.error: NodeTimeoutError | None = None
        self.delivered = False  # set by the scheduler once the interrupt arrived
        self._target = threading.get_ident()  # the thread the sim runs on: the caller's
        self._stop = threading.Event()
        self._lock = threading.Lock()  # between firing (watchdog thread) and leaving the run (sim's thread)
        self._active = False
        self._thread: threading.Thread | None = None
        self._handlers: dict[int, Any] = {}  # signal -> its handler before the run (empty: no signal handlers)
        self._raised = False  # the kick handler raised the interrupt (it raises at most once)
        self._interrupted = False  # an interrupt handler raised in the sim's thread: the watchdog stays silent
        self._deferred: tuple[Callable[..., Any], int] | None = None  # an interrupt held back while nodes unwind

    def __enter__(self) -> "Watchdog":
        if self.timeout is not None:
            if _can_kick():
                self._install_handlers()
            self._active = True
            self._thread = threading.Thread(target=self._watch, name="exogym-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        try:
            # A plain store, first: the kick handler runs on this thread, and from here on it never raises.
            self._active = False
        finally:  # an interrupt may land before that store, but only once (_raised): the cleanup still runs
            self._close()

    def _close(self) -> None:
        self._active = False
        try:
            with self._lock:
                if self.error is not None and not self.delivered and not self._handlers:
                    _set_async_exc(self._target, None)  # the node got free on its own: drop the interrupt
            self._stop.set()
            self._thread.join()
        finally:  # even when Ctrl-C ends the join: the caller's handlers come back
            for signum, handler in self._handlers.items():
                signal.signal(signum, handler)

    def raise_deferred(self) -> None:
        """Run the interrupt (Ctrl-C, SIGTERM) that arrived while the watchdog's interrupt unwound the nodes: its
        handler before the run raises what it raises (KeyboardInterrupt). Nothing was deferred: returns."""
        if self._deferred is not None:
            handler, signum = self._deferred
            self._deferred = None
            handler(signum, None)

    # ---- signals (main thread only) -------------------------------------------------------------------------
    def _install_handlers(self) -> None:
        self._handlers[KICK_SIGNAL] = signal.signal(KICK_SIGNAL, self._on_kick)
        for signum in _INTERRUPTS:
            if callable(signal.getsignal(signum)):  # a Python handler, which may raise (Ctrl-C's does)
                self._handlers[signum] = signal.signal(signum, self._on_interrupt)

    def _on_kick(self, signum: int, frame: Any) -> None:
        if self.error is None:  # not the watchdog's: what the handler before the run would do
            previous = self._handlers.get(signum)
            if callable(previous):
                previous(signum, frame)
            return
        if self._active and not self._raised and not self._interrupted:
            self._raised = True
            raise WatchdogInterrupt

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        previous = self._handlers[signum]
        if self._raised and self._active and self._deferred is None:
            # The watchdog's interrupt is unwinding the nodes: raising now would land in their cleanup (a lock
            # released twice). Held back until they have unwound; a second one goes through.
            self._deferred = (previous, signum)
            return
        try:
            previous(signum, frame)
        except BaseException:
            self._interrupted = True
            raise

    # ---- the watchdog's thread ------------------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.timeout / 10)
        last, since = self._progress(), time.monotonic()
        checked = since
        while not self._stop.wait(period):
            sample, now = self._progress(), time.monotonic()
            if sample != last:
                last, since = sample, now
            elif importing_torch(sys._current_frames().get(self._target)):
                since = min(now, since + (now - checked))  # torch importing its own modules is not the node's time
            elif now - since >= self.timeout and sample[0] is not None:
                if not self._fire(sample, now - since):
                    return
                break
            checked = now
        else:
            return
        if not self._stop.wait(self.grace):
            self._give_up(sample)

    def _fire(self, sample: tuple, held_s: float) -> bool:
        rank, step = sample[0], sample[2]
        frame = sys._current_frames().get(self._target)
        stack = "".join(traceback.format_stack(frame)[-25:]) if frame is not None else "  (not available)\n"
        if rank == SERVER:  # the keeper ran the server's handler: step is (the server's class, what it handles)
            server, what = step
            error: NodeTimeoutError = ServerTimeoutError(
                f"the server ({server}) ran for {held_s:.1f} s handling {what} without returning, longer than "
                f"node_timeout={self.timeout:g} s, so the run was stopped; it was here:\n{stack.rstrip()}\n"
                "A server's receive or wake that never returns holds every node up forever. If it really takes "
                "this long, pass fit(node_timeout=<seconds>) or node_timeout=None.", server, what)
        elif sample[3] is not None:  # fused execution: the parked nodes' batched step
            nodes = list(sample[3])
            error = NodeTimeoutError(
                f"the batched step of nodes {nodes} (fused execution; node {rank} at step {step}) ran for "
                f"{held_s:.1f} s without finishing, longer than node_timeout={self.timeout:g} s, so the run was "
                f"stopped; it was here:\n{stack.rstrip()}\nA model or strategy that loops or waits in its step holds "
                "every node up forever. If a batched step really takes this long, pass fit(node_timeout=<seconds>) "
                "or node_timeout=None.", rank, step)
        else:
            where = f"in step {step} without finishing it" if step is not None else "before its first step"
            error = NodeTimeoutError(
                f"node {rank} ran for {held_s:.1f} s {where} or reaching a collective, longer than "
                f"node_timeout={self.timeout:g} s, so the run was stopped; it was here:\n{stack.rstrip()}\n"
                "A node that loops or waits without reaching a collective holds the others up forever. If its "
                "steps really take this long, pass fit(node_timeout=<seconds>) or node_timeout=None.", rank, step)
        with self._lock:
            if not self._active:
                return False
            self.error = error
            if self._handlers:
                signal.pthread_kill(self._target, KICK_SIGNAL)
            else:
                _set_async_exc(self._target, WatchdogInterrupt)
        return True

    def _give_up(self, fired_at: tuple) -> None:
        """The node did not stop within the grace period: name it on stderr; with on_stuck, record it and exit."""
        fired = self.error
        who = "the server" if isinstance(fired, ServerTimeoutError) else f"node {fired.rank}"
        if self._progress() != fired_at:
            _say(f"exogym watchdog: {who} caught the watchdog's interrupt (node_timeout={self.timeout:g} s "
                 "passed in its step) and carried on; nothing stops it again in this run. A node must not catch "
                 "BaseException.\n")
            return
        ends = (f"Its process ({os.getpid()}) exits now with code {STUCK_EXIT_CODE}: the call cannot be unwound."
                if self._on_stuck else f"Its process is left running (no on_stuck was given): end it with `kill "
                f"{os.getpid()}`, as Ctrl-C cannot reach native code.")
        text = (f"{fired}\n{who[0].upper()}{who[1:]} was still running {self.grace:g} s after the watchdog tried to "
                "stop it: it is inside native code that ignores signals (a C or C++ call that waits or loops; the last "
                "Python line above called it). " + ends)
        error = (ServerTimeoutError(text, fired.server, fired.handling) if isinstance(fired, ServerTimeoutError)
                 else NodeTimeoutError(text, fired.rank, fired.step))
        with self._lock:
            if not self._active:  # the run stopped after all
                return
            _say(f"exogym watchdog: {error}\n")
            if self._on_stuck is None:
                return
            recorder = threading.Thread(target=self._on_stuck, args=(error,), name="exogym-on-stuck", daemon=True)
            recorder.start()
            recorder.join(_ON_STUCK_S)
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - as in _say
                    pass
            os._exit(STUCK_EXIT_CODE)


class SpinWatch:
    """One node's polls (poll, read_server): a node that asks again and again at one simulated time, while no other
    node of its process is given a turn and it takes no message, is stopped once it has done so for node_timeout
    seconds: a poll never waits, so such a loop spins forever when no message is due by
    its clock. The watchdog's thread cannot see it: each poll is an observation, which it counts as progress (and
    over several processes the node hands the baton on at every poll). Checked in the node itself, at its next poll:
    a clock read and a tuple compare per poll.

    Args:
        timeout: node_timeout (None: no limit).
    """

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self._key: tuple | None = None  # (the node's clock, its process's progress) after its last poll
        self._since = 0.0

    def before(self, rank: int, step: int | None, at: float, progress: int, what: str) -> None:
        """Node `rank` is about to poll at its clock `at`; `progress` counts the turns its process's other nodes were
        given so far.

        Raises:
            NodeTimeoutError: it has polled at this clock, with nothing else moving, for node_timeout seconds.
        """
        if self.timeout is None or self._key != (at, progress):
            return
        held = time.monotonic() - self._since
        if held >= self.timeout:
            self._key = None
            raise NodeTimeoutError(
                f"node {rank} called {what} again and again for {held:.1f} s at simulated time {at:.6g} s without its "
                f"simulated clock moving, while no other node of its process was given a turn, longer than "
                f"node_timeout={self.timeout:g} s, so the run was stopped. {what} never waits: a loop of them at one "
                "clock spins forever when nothing is due by then. Wait with recv() (or compute between polls, so "
                "that the clock moves); if nothing is wrong, pass fit(node_timeout=<seconds>) or node_timeout=None.",
                rank, step)

    def after(self, at: float, progress: int, took: bool) -> None:
        """The poll returned; `took`: it returned something (progress of the node's own)."""
        key = None if took else (at, progress)
        if key != self._key or key is None:
            self._since = time.monotonic()
        self._key = key


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def importing_torch(frame: Any) -> bool:
    """Whether the thread whose innermost frame this is runs the body of a torch module: torch imports some of its
    own modules on first use (a node's first torch.optim optimizer imports torch._dynamo, seconds on a loaded
    machine), which the watchdog does not count as the node's time."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and code.co_filename.startswith(_TORCH_DIR):
            return True
        frame = frame.f_back
    return False


def _say(text: str) -> None:
    """Write on stderr; a closed or broken stderr must not keep the watchdog from ending the process."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def _can_kick() -> bool:
    """Whether the watchdog can signal the sim's thread: the main thread, with pthread_kill, and a handler for
    KICK_SIGNAL that Python can restore after the run (getsignal is None for one installed outside Python)."""
    return (KICK_SIGNAL is not None and hasattr(signal, "pthread_kill")
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(KICK_SIGNAL) is not None)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `thread_id` at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc) if exc is not None else None)
