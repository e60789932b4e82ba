"""The sweep's results: one row per configuration, the best one, the Pareto frontier, CSV and Markdown.

A row holds the configuration's parameters, its status, how many seeds completed, and for the objective and
every metric of the runs the mean over the seeds (under the metric's name) and the sample standard deviation
(`<name>_std`, empty for one seed). `feasible` is False when a run broke the objective's constraints.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from exogym.sweep.objective import Objective, metric_name
from exogym.sweep.study import Entry

__all__ = ["table_rows", "best_row", "pareto", "write_csv", "markdown", "FIRST_METRICS"]

# The table's first metric columns (then every other metric, by name).
FIRST_METRICS = ("payload_bytes_per_node", "wire_bytes_per_node", "sim_time_s", "wall_time_s")


def table_rows(entries: Iterable[Entry], params: Sequence[str], folder: Path) -> list[dict[str, Any]]:
    """One row per entry; run_dirs are the runs' folders under the sweep folder `folder`, space-separated."""
    rows = []
    for e in entries:
        done = [o for _, o in sorted(e.runs.items()) if o.status == "completed"]
        row: dict[str, Any] = {p: e.config.get(p) for p in params}
        # A configuration the study calls completed whose outcomes neither it nor the run folders hold: never shown
        # as completed without its numbers.
        status = "results lost" if e.status == "completed" and not done else e.status
        row.update(status=status, seeds=len(done), attempts=e.attempts)
        names = sorted({k for o in done for k in o.metrics} - {"violation"})
        for name in ["objective"] + [n for n in names if n != "objective"]:
            values = [o.metrics[name] for o in done if name in o.metrics]
            row[name] = statistics.fmean(values) if values else None
            row[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else None
        row["feasible"] = all(o.metrics.get("violation", 0.0) <= 0 for o in done) if done else None
        bad = next((o for o in e.runs.values() if o.status in ("failed", "diverged")), None)
        row["error"] = (f"seed {bad.seed}: " + (bad.error or "").strip().splitlines()[0]) if bad and bad.error else ""
        if status == "results lost":
            row["error"] = "the study says completed, but neither it nor the run folders hold the runs' outcomes"
        row["run_dirs"] = " ".join(str(folder / o.run_dir) for _, o in sorted(e.runs.items()) if o.run_dir)
        rows.append(row)
    return rows


def _better(objective: Objective) -> Any:
    return (lambda v: v) if objective.direction == "minimize" else (lambda v: -v)


def best_row(rows: Sequence[dict[str, Any]], objective: Objective) -> dict[str, Any] | None:
    """The completed, feasible configuration with the best mean objective (None if there is none)."""
    ok = [r for r in rows if r["status"] == "completed" and r["feasible"] and r["objective"] is not None
          and math.isfinite(r["objective"])]
    return min(ok, key=lambda r: _better(objective)(r["objective"])) if ok else None


def pareto(rows: Sequence[dict[str, Any]], x: str, y: str, *, maximize_y: bool = False) -> list[dict[str, Any]]:
    """The rows no other row beats on both x (lower is better: bytes, time) and y; sorted by x.

    A row is on the frontier when every row with x at most its x has a worse y (ties in x: the best y)."""
    x, y = metric_name(x), metric_name(y)
    sign = -1.0 if maximize_y else 1.0
    points = [r for r in rows if _number(r.get(x)) and _number(r.get(y))]
    points.sort(key=lambda r: (r[x], sign * r[y]))
    frontier, best = [], math.inf
    for r in points:
        if sign * r[y] < best:
            frontier.append(r)
            best = sign * r[y]
    return frontier


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _columns(rows: Sequence[dict[str, Any]], params: Sequence[str]) -> list[str]:
    seen = list(dict.fromkeys(k for r in rows for k in r))
    metrics = [k for k in seen if k not in params and k not in ("status", "seeds", "attempts", "objective",
                                                                "objective_std", "feasible", "error", "run_dirs")]
    means = [m for m in metrics if not m.endswith("_std")]
    ordered = [m for m in FIRST_METRICS if m in means] + sorted(m for m in means if m not in FIRST_METRICS)
    return list(params) + ["status", "seeds", "objective", "objective_std", "feasible"] + \
        [c for m in ordered for c in (m, f"{m}_std") if c in seen] + ["attempts", "error", "run_dirs"]


def write_csv(rows: Sequence[dict[str, Any]], params: Sequence[str], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_columns(rows, params), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return path


def _fmt(value: Any, std: Any = None, digits: int = 4) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return text + (f" ± {std:.{digits}f}" if std is not None else "")


def markdown(rows: Sequence[dict[str, Any]], params: Sequence[str], objective: Objective) -> str:
    """Parameters, objective (mean ± std over seeds), MB sent per node (payload, wire), simulated and wall
    seconds, seeds and status; the best configuration in bold."""
    best = best_row(rows, objective)
    head = list(params) + [f"{objective.metric} (mean ± std)", "payload MB/node", "wire MB/node", "sim s",
                           "wall s", "seeds", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(params) + "---:|" * 6 + "---|"]
    for r in rows:
        mb = [_fmt(r.get(k) / 1e6, None, 2) if r.get(k) is not None else "-"
              for k in ("payload_bytes_per_node", "wire_bytes_per_node")]
        obj = _fmt(r["objective"], r["objective_std"])
        if r is best:
            obj = f"**{obj}**"
        status = r["status"] + ("" if r["feasible"] in (True, None) else ", infeasible")
        cells = ["-" if r[p] is None else f"{r[p]:.4g}" if isinstance(r[p], float) else str(r[p]) for p in params] + [obj, *mb, _fmt(r.get("sim_time_s"), None, 1),
                                                _fmt(r.get("wall_time_s"), None, 1), str(r["seeds"]), status]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
