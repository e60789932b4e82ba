"""How a run ended, as a typed value: completed, failed (with its error), interrupted (with the signal, and the
checkpoint to resume from) or stuck (a node that made no progress for node_timeout); and a non-finite loss traced to
the node and step where it first appeared. exogym.fit.lifecycle records the ending; this module only says what it is."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from exogym.backends.errors import NodeProcessError, NodeTimeoutError, PeerLostError
from exogym.engine.node import NonFiniteLoss
from exogym.launch.signals import interrupt_signal
from exogym.runs.checkpoint import CheckpointError, find_checkpoint
from exogym.runs.record import NodeLog, first_non_finite

__all__ = ["Ending", "trace_non_finite", "COMPLETED", "FAILED", "INTERRUPTED", "STUCK"]

COMPLETED, FAILED, INTERRUPTED, STUCK = "completed", "failed", "interrupted", "stuck"


@dataclass(frozen=True)
class Ending:
    """How a run ended.

    Attributes:
        status: COMPLETED, FAILED, INTERRUPTED or STUCK.
        error: what stopped it (None when it completed).
        signal: the signal that interrupted it (INTERRUPTED only).
        resume_from: the newest checkpoint to continue it from (INTERRUPTED only; None when it has none).
    """

    status: str
    error: BaseException | None = None
    signal: signal.Signals | None = None
    resume_from: str | None = None

    @classmethod
    def of(cls, error: BaseException, checkpoint_root: Path | None) -> "Ending":
        """The ending of a run that stopped on `error`.

        Args:
            error: what the run raised (a KeyboardInterrupt for a signal; a NodeTimeoutError for a stuck node).
            checkpoint_root: the run's checkpoint folder, where an interrupted run finds its newest checkpoint.

        Returns:
            INTERRUPTED (with the signal and the newest checkpoint), STUCK, or FAILED.
        """
        if isinstance(error, KeyboardInterrupt):
            newest = None
            if checkpoint_root is not None:
                with contextlib.suppress(CheckpointError, OSError):
                    newest = str(find_checkpoint(checkpoint_root))
            return cls(INTERRUPTED, error, interrupt_signal(error), newest)
        return cls(STUCK if isinstance(error, NodeTimeoutError) else FAILED, error)

    @property
    def reason(self) -> str | None:
        """The error, as the run folder's marker and summary.json say it: "ValueError: ..."."""
        if self.error is None or self.status == INTERRUPTED:
            return None
        return f"{type(self.error).__name__}: {self.error}"

    def summary(self) -> dict[str, Any]:
        """What summary.json says of the ending. On disk a stuck run's status is "failed" (with "stuck": true):
        readers of run folders know the three statuses completed, failed and interrupted."""
        if self.status == COMPLETED:
            return {"status": COMPLETED}
        if self.status == INTERRUPTED:
            return {"status": INTERRUPTED, "signal": self.signal.name, "resume_from": self.resume_from}
        lost = self.lost_peer
        return {"status": FAILED, "error": self.reason, **({"stuck": True} if self.status == STUCK else {}),
                **({"lost_peer": lost} if lost is not None else {})}

    @property
    def lost_peer(self) -> dict[str, Any] | None:
        """The process the run lost (its rank and nodes), when a process went away or stopped responding."""
        error = self.error
        lost = error if isinstance(error, PeerLostError) else getattr(error, "__cause__", None)
        if not isinstance(lost, PeerLostError):
            return None
        return {"process": lost.process, "nodes": list(lost.nodes)}

    @property
    def folder_status(self) -> str:
        """The marker's status: as summary.json's."""
        return self.summary()["status"]


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
