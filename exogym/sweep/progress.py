"""What a sweep shows while it runs: a bar over configurations with the best so far, and a line for each
configuration as it ends (its objective, mean and spread over seeds, and the bytes a node sent)."""

from __future__ import annotations

from tqdm.auto import tqdm

from exogym.runs.progress import human_bytes
from exogym.sweep.report import SweepResult
from exogym.sweep.results import best_row

__all__ = ["SweepProgress"]


class SweepProgress:
    """The progress bar over configurations, with the best so far; a line per configuration as it ends."""

    def __init__(self, result: SweepResult, total: int, *, enabled: bool):
        self.result, self.enabled = result, enabled
        self.bar = tqdm(total=total, desc="sweep", unit="config", dynamic_ncols=True) if enabled else None
        self.reported: set[str] = set()

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)

    def refresh(self) -> None:
        if self.bar is None:
            return
        rows = self.result.table()
        params = self.result.params
        finished = [r for r in rows if r["status"] in ("completed", "diverged", "failed")]
        for r in finished:
            label = ", ".join(f"{p}={r[p]}" for p in params if r.get(p) is not None)
            if label in self.reported:
                continue
            self.reported.add(label)
            value = f"{r['objective']:.4f}" + (f" ± {r['objective_std']:.4f}" if r["objective_std"] else "") \
                if r["objective"] is not None else ""
            sent = f", {human_bytes(r['payload_bytes_per_node'])} per node" if r.get("payload_bytes_per_node") else ""
            text = f"{self.result.objective.metric} {value}{sent}" if r["status"] == "completed" else r["error"]
            self.bar.write(f"  {label}: {r['status']}: {text}")
        best = best_row(rows, self.result.objective)
        failed = sum(r["status"] in ("failed", "diverged") for r in rows)
        post = (f"best {best['objective']:.4f}" if best else "") + (f", {failed} failed/diverged" if failed else "")
        if (self.bar.n, self.bar.postfix) != (len(finished), post):  # redraw on news only (logs stay short)
            self.bar.n = len(finished)
            self.bar.set_postfix_str(post, refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
