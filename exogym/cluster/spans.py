"""Where a node's simulated seconds went, as spans on its clock: the record a run's timeline is drawn from.

A node's clock only moves forward, and every move has a kind: compute, slowed (a step stretched by a transient
slowdown: its compute and the stretch together), comm (a blocking transfer, or a send waited on), idle (waiting for the other members of a collective,
for a message, or for an async transfer to end) and down (idle while the node was down). So a node's spans tile
[start, now] with no gap: the log keeps only the boundaries, one kind per span and the step each span began in, and
a span continuing the previous one's kind extends it (ten DiLoCo inner steps in a row are one compute span). A
64-node run of 2,000 rounds keeps a few spans per node per round, never one per step.

Messages are kept beside the spans: each one a node sent (to a node or the server), when it left and arrived,
its bytes and the sender's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SpanLog", "SPAN_KINDS", "MESSAGE_COLUMNS"]

# One letter per kind in `kinds` (a string of letters keeps a long log small on disk and in the browser).
SPAN_KINDS = {"c": "compute", "m": "comm", "i": "idle", "d": "down", "s": "slowed"}
MESSAGE_COLUMNS = ("dst", "sent", "arrives", "bytes", "step")


@dataclass
class SpanLog:
    """One clock's spans and sent messages, as plain lists (checkpoints and processes carry it as is).

    Attributes:
        t: The span boundaries in simulated seconds; span i runs from t[i] to t[i+1].
        kinds: One letter per span (SPAN_KINDS).
        steps: The step each span began in (the step being computed; 0 before the first).
        messages: Columns MESSAGE_COLUMNS of the messages sent (dst -1 is the server).
        step: The step the node is in now (set by the node).
        down: Whether the node is down now: its idle time is down time until it computes again.
    """

    t: list[float] = field(default_factory=lambda: [0.0])
    kinds: str = ""
    steps: list[int] = field(default_factory=list)
    messages: dict[str, list[float]] = field(default_factory=lambda: {c: [] for c in MESSAGE_COLUMNS})
    step: int = 0
    down: bool = False

    def advance(self, kind: str, to: float) -> None:
        """The clock moved from the last boundary to `to`, doing `kind` (a letter of SPAN_KINDS)."""
        if not to > self.t[-1]:
            return
        if kind == "i" and self.down:
            kind = "d"
        elif kind in "cs":
            self.down = False
        if self.kinds and self.kinds[-1] == kind:
            self.t[-1] = to
        else:
            self.t.append(to)
            self.kinds += kind
            self.steps.append(self.step)

    def sent(self, dst: int, sent: float, arrives: float, nbytes: int) -> None:
        """A message left at `sent` for `dst` (-1: the server) and arrives at `arrives`."""
        for column, value in zip(MESSAGE_COLUMNS, (dst, sent, arrives, nbytes, self.step)):
            self.messages[column].append(value)

    def seconds(self) -> dict[str, float]:
        """Seconds per kind (SPAN_KINDS' names), summed over the spans."""
        out = {name: 0.0 for name in SPAN_KINDS.values()}
        for i, k in enumerate(self.kinds):
            out[SPAN_KINDS[k]] += self.t[i + 1] - self.t[i]
        return out

    def to_plain(self) -> dict[str, Any]:
        """The log as JSON-ready data (the run folder's timeline.json holds one per node)."""
        # the messages' columns are the log's own lists: on shared links a message's arrival is filled in when its
        # flow ends, which may be after its sender's log was kept (exogym.backends.sim.postoffice)
        return {"t": list(self.t), "kinds": self.kinds, "steps": list(self.steps), "messages": self.messages}
