"""How a fit call ends when it does not complete: SIGTERM interrupts it as Ctrl-C does, what its nodes trained is
kept, a non-finite loss is traced to the node and step where it first appeared, and the run folder says how it
ended: "failed" (with the error) or "interrupted" (SIGINT or SIGTERM, with the checkpoint to resume from)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Sequence

from exogym.backends.errors import NodeProcessError
from exogym.engine.node import NonFiniteLoss
from exogym.launch.signals import interrupt_signal
from exogym.runs.checkpoint import CheckpointError, find_checkpoint
from exogym.runs.record import NodeLog, first_non_finite

__all__ = ["trace_non_finite", "ending"]


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
        where = (f"on every node is {value} at step {step}, the run's first non-finite loss: the parameters they "
                 f"share became non-finite in step {step - 1}'s update (a non-finite gradient on some node, or a "
                 "learning rate too large; to name the node, run again under torch.autograd.detect_anomaly(): the "
                 "backward that makes a nan then raises, naming its node and step)")
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
    return {"status": "interrupted", "signal": interrupt_signal(error).name, "resume_from": newest}
