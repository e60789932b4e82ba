"""What a run shows while it trains: a bar fed with the same merged rows as the record and train.csv.

The bar's loss is the step's loss averaged over the nodes up (record.train's "loss"); "sent" is the
bytes sent per node so far (record.train's "bytes"); "val" is the global model's latest validation loss.
When the run ends, one line sums it up.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from tqdm.auto import tqdm

__all__ = ["RunProgress", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"


class RunProgress:
    """A step bar for one run (on stderr), and the line that closes it (on stdout)."""

    def __init__(self, total: int, *, initial: int = 0, label: str = "exogym"):
        self.label = label
        self.bar = tqdm(total=total, initial=initial, desc=label, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.last: dict[str, float] = {}
        self.val: dict[str, float] = {}

    def train_row(self, row: dict[str, float]) -> None:
        self.last = row
        self.bar.update(1)
        self._postfix()

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
