"""How a fit call ends when it does not complete: SIGTERM interrupts it as Ctrl-C does, what its nodes trained is
kept, a non-finite loss is traced to the node and step where it first appeared, and the run folder says how it
ended: "failed" (with the error) or "interrupted" (SIGINT or SIGTERM, with the checkpoint to resume from)."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from exogym.backends.errors import NodeProcessError
from exogym.engine.node import NonFiniteLoss
from exogym.runs.checkpoint import CheckpointError, find_checkpoint
from exogym.runs.record import NodeLog, first_non_finite

__all__ = ["RunInterrupted", "interrupt_on_sigterm", "trace_non_finite", "ending", "signal_of"]


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped by a signal (SIGTERM: a scheduler's preemption, `kill`, a container stopping); like
    Ctrl-C's KeyboardInterrupt, which it is a kind of. `signal_name` says which."""

    def __init__(self, signal_name: str):
        super().__init__(f"the run was stopped by {signal_name}")
        self.signal_name = signal_name


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """While fit runs, SIGTERM raises RunInterrupted where the run is (on the main thread, and only where SIGTERM
    has its default action: a handler of the caller's own is left alone); the default is put back after."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise RunInterrupted("SIGTERM")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def trace_non_finite(error: BaseException, logs: Sequence[NodeLog]) -> BaseException:
    """A non-finite loss (raised by whichever node saw one first, perhaps after an average spread it to that node)
    becomes a NonFiniteLoss naming where it first appeared, from every node's rows: the earliest step, and the
    nodes with a non-finite loss at that step. Other errors are returned as they are."""
    cause = error if isinstance(error, NonFiniteLoss) else error.__cause__ if isinstance(error, NodeProcessError) \
        else None
    if not isinstance(cause, NonFiniteLoss):
        return error
    first = first_non_finite(logs)
    if first is None or cause.table == "val" and first[0] > cause.step:
        return cause  # a validation loss, with every training loss before it finite
    step, ranks, value = first
    if len(ranks) == len(logs) > 1 and step > 1:
        # The record shows every node finite through step - 1 and non-finite at step: an update of step - 1 that
        # made the shared parameters non-finite, and a forward pass of step that is non-finite on every node, both
        # give that. Neither is named as the cause; anomaly detection tells them apart.
        where = (f"on every node is {value} at step {step}, the run's first non-finite loss (every node's loss "
                 f"was finite through step {step - 1}): either step {step - 1}'s update made the parameters they "
                 f"share non-finite (a non-finite gradient on some node, or a learning rate too large), or step "
                 f"{step}'s forward pass is non-finite on every node (a log of 0, a division by 0 in the model); to "
                 "tell which and name the node, run again under torch.autograd.detect_anomaly(): the forward or "
                 "backward that makes a nan then raises, naming its node and step")
    else:
        nodes = f"node {ranks[0]}" if len(ranks) == 1 else f"nodes {', '.join(map(str, ranks))}"
        where = (f"on {nodes} is {value} at step {step}, the run's first non-finite loss"
                 + (" (an average then spreads it to the other nodes)" if len(logs) > 1 else ""))
    traced = NonFiniteLoss(f"the training loss {where}; lower the learning rate, set max_norm, or check the data",
                           ranks[0], step, value)
    traced.__traceback__ = error.__traceback__
    return traced


def ending(error: BaseException, checkpoint_root: Path | None) -> dict[str, Any]:
    """What the run folder's summary says of a run that stopped: "interrupted" (SIGINT, SIGTERM: resumable from
    the newest checkpoint, named) or "failed", with the error."""
    if not isinstance(error, KeyboardInterrupt):
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}
    newest = None
    if checkpoint_root is not None:
        with contextlib.suppress(CheckpointError, OSError):
            newest = str(find_checkpoint(checkpoint_root))
    return {"status": "interrupted", "signal": signal_of(error), "resume_from": newest}


def signal_of(interrupt: BaseException) -> str:
    """Which signal a KeyboardInterrupt stands for: RunInterrupted's, a handler's that raised
    KeyboardInterrupt("SIGTERM") (a sweep worker, a simulating process), else Ctrl-C's SIGINT."""
    name = getattr(interrupt, "signal_name", None) or str(interrupt)
    return name if name in signal.Signals.__members__ else "SIGINT"
