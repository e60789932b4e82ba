"""The one SIGTERM handler of a run, and the typed interrupt it raises.

A run stops on Ctrl-C (SIGINT: Python raises KeyboardInterrupt) and on SIGTERM (a scheduler's preemption, `kill`,
a container stopping, or the caller ending one of the run's processes). Python's default for SIGTERM ends the
process on the spot, with nothing recorded; so while a run is in a process, SIGTERM raises `RunInterrupted`, a
KeyboardInterrupt that carries the signal as a `signal.Signals` value. The same handler serves the calling process
and every process a launcher starts.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["RunInterrupted", "interrupt_on_sigterm", "raise_on_sigterm", "interrupt_signal"]


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by a signal; like Ctrl-C's KeyboardInterrupt, which it is a kind of.

    Args:
        signum: the signal that stopped it (a number, a `signal.Signals`, or its name).

    Attributes:
        signal: the signal, as a `signal.Signals` value.
        signal_name: its name ("SIGTERM").
    """

    def __init__(self, signum: signal.Signals | int | str):
        self.signal = signal.Signals[signum] if isinstance(signum, str) else signal.Signals(signum)
        super().__init__(f"the run was stopped by {self.signal.name}")

    @property
    def signal_name(self) -> str:
        """The signal's name (`"SIGTERM"`)."""
        return self.signal.name

    def __reduce__(self) -> tuple:  # crosses from a run's process to the caller intact
        return type(self), (int(self.signal),)


def _raise(signum: int, frame: Any) -> None:
    raise RunInterrupted(signum)


def raise_on_sigterm() -> None:
    """In a process a launcher started: SIGTERM raises RunInterrupted for as long as the process lives."""
    signal.signal(signal.SIGTERM, _raise)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """In the calling process, while a run runs: SIGTERM raises RunInterrupted where the run is.

    Only on the main thread, and only where SIGTERM has its default action (a handler of the caller's own is left
    alone); the default is put back after.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def interrupt_signal(interrupt: KeyboardInterrupt) -> signal.Signals:
    """Which signal stopped a run, as a typed value.

    Args:
        interrupt: what the run raised.

    Returns:
        RunInterrupted's signal; for another KeyboardInterrupt that names its signal (a `signal_name` attribute, or
        a message that is the signal's name, as a SIGTERM handler of the caller's own may raise), that signal; else
        Ctrl-C's SIGINT.
    """
    if isinstance(interrupt, RunInterrupted):
        return interrupt.signal
    name = getattr(interrupt, "signal_name", None) or str(interrupt)
    return signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGINT
