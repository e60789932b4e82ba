"""What a run shows while it trains: a bar fed with the same merged rows as the record and train.csv.

The bar's loss is the step's loss averaged over the nodes up (record.train's "loss"); "sent" is the
bytes sent per node so far (record.train's "bytes"); "val" is the global model's latest validation loss.
When the run ends, one line sums it up.

The time left is estimated from the steps after the first one only, and shown once ESTIMATE_AFTER_STEPS of them
took ESTIMATE_AFTER_S seconds or more: a run's first step also imports what torch loads lazily, builds every node's
optimizer and, under load, waits for the machine (seconds, against milliseconds for the next ones), so tqdm's own
estimate after step 1 said minutes for a run of seconds.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable

from tqdm.auto import tqdm

__all__ = ["RunProgress", "human_bytes", "ESTIMATE_AFTER_STEPS", "ESTIMATE_AFTER_S"]

ESTIMATE_AFTER_STEPS = 3  # steps after the first one measured before the time left is shown
ESTIMATE_AFTER_S = 1.0  # ... over at least this long, so that one step's noise does not make the estimate
# tqdm's layout without its own rate and time left (both averaged over the first step); ours is in the postfix.
_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


class RunProgress:
    """A step bar for one run (on stderr), and the line that closes it (on stdout)."""

    def __init__(self, total: int, *, initial: int = 0, label: str = "exogym",
                 clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self._clock = label, total, clock
        self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True, file=sys.stderr,
                        bar_format=_FORMAT)
        self.last: dict[str, float] = {}
        self.val: dict[str, float] = {}
        self.steps = initial  # the steps done
        self._first: tuple[int, float] | None = None  # (steps, time) when this process's first step ended

    def train_row(self, row: dict[str, float]) -> None:
        self.last = row
        self.steps += 1
        if self._first is None:
            self._first = (self.steps, self._clock())
        self.bar.update(1)
        self._postfix()

    def seconds_left(self) -> float | None:
        """The time the remaining steps will take at the pace of the steps after the first; None until
        ESTIMATE_AFTER_STEPS of them took ESTIMATE_AFTER_S seconds or more."""
        if self._first is None:
            return None
        steps, since = self.steps - self._first[0], self._clock() - self._first[1]
        if steps < ESTIMATE_AFTER_STEPS or since < ESTIMATE_AFTER_S:
            return None
        return (self.total - self.steps) * since / steps

    def val_row(self, row: dict[str, float]) -> None:
        self.val = row
        self._postfix()

    def _postfix(self) -> None:
        parts = []
        if self.last:
            parts.append(f"loss {self.last.get('loss', math.nan):.4f}")
            parts.append(f"sent/node {human_bytes(self.last['bytes'])}")
            if "sim_time_s" in self.last:
                parts.append(f"sim {self.last['sim_time_s']:.1f}s")
        if "global_loss" in self.val:
            parts.append(f"val {self.val['global_loss']:.4f}")
        left = self.seconds_left()
        if left is not None:
            parts.append(f"{tqdm.format_interval(left)} left")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the bar; with a summary (the run completed), print the run's one-line result."""
        self.bar.close()
        if summary is None:
            return
        parts = [f"{summary['steps']} steps in {summary['wall_time_s']:.1f} s"]
        if self.last and "loss" in self.last:
            parts.append(f"train loss {self.last['loss']:.4f}")
        for key in ("global_loss", "global_accuracy"):
            if key in self.val:
                value = self.val[key]
                parts.append(f"val {key[7:]} " + (f"{value:.2%}" if key.endswith("accuracy") else f"{value:.4f}"))
        if self.last:
            parts.append(f"sent {human_bytes(self.last['bytes'])} per node")
        if summary.get("sim_time_s") is not None:
            parts.append(f"simulated {summary['sim_time_s']:.1f} s")
        print(f"{self.label}: done: " + ", ".join(parts), flush=True)
