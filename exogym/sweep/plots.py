"""The sweep's pictures: the loss-vs-communication frontier and a heatmap of a two-parameter grid.

Both take the rows of results.table_rows and need matplotlib (`pip install 'exogym[plot]'`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from exogym.sweep.objective import Objective
from exogym.sweep.results import best_row, pareto

__all__ = ["plot_frontier", "plot_heatmap", "heatmap_axes"]

_X_LABELS = {"payload_bytes_per_node": "payload bytes sent per node", "sim_time_s": "simulated seconds",
             "wire_bytes_per_node": "wire bytes sent per node", "wall_time_s": "wall-clock seconds"}


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the sweep's plots need matplotlib: pip install 'exogym[plot]'") from e
    fig = Figure(figsize=(width, height), layout="constrained")  # no pyplot: no global state, works headless
    FigureCanvasAgg(fig)
    return fig


def _label(row: dict[str, Any], params: Sequence[str]) -> str:
    return ", ".join(f"{p}={row[p]}" for p in params if row.get(p) is not None)


def plot_frontier(rows: Sequence[dict[str, Any]], params: Sequence[str], objective: Objective, out: Path,
                  xs: Sequence[str] = ("payload_bytes_per_node", "sim_time_s")) -> Path | None:
    """The objective against each x (one panel each, those the runs have): a marker per configuration, the
    Pareto set joined and labelled, log axes (an x of 0, e.g. one node sending nothing, sits at the left edge
    of a symmetric-log axis). None when no configuration has a number to draw."""
    done = [r for r in rows if r["status"] == "completed" and r["objective"] is not None]
    xs = [x for x in xs if any(r.get(x) is not None for r in done)]
    if not done or not xs:
        return None
    fig = _figure(6.5 * len(xs), 4.8)
    maximize = objective.direction == "maximize"
    for i, x in enumerate(xs):
        ax = fig.add_subplot(1, len(xs), i + 1)
        points = [r for r in done if r.get(x) is not None]
        ax.scatter([r[x] for r in points], [r["objective"] for r in points], s=28, color="0.55", alpha=0.8,
                   label="configuration", zorder=2)
        front = pareto(points, x, "objective", maximize_y=maximize)
        ax.plot([r[x] for r in front], [r["objective"] for r in front], drawstyle="steps-post", color="C3",
                marker="o", markersize=7, fillstyle="none", linewidth=1.5, label="Pareto frontier", zorder=3)
        for r in front:
            ax.annotate(_label(r, params), (r[x], r["objective"]), textcoords="offset points", xytext=(5, 4),
                        fontsize=7, color="C3")
        positive = [r[x] for r in points if r[x] > 0]
        if positive and len(positive) < len(points):
            ax.set_xscale("symlog", linthresh=min(positive))
        elif positive:
            ax.set_xscale("log")
        if all(r["objective"] > 0 for r in points):
            from matplotlib.ticker import FuncFormatter
            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.92, not 9.2x10^-1
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel(_X_LABELS.get(x, x.replace("_", " ")))
        ax.set_ylabel(objective.metric.replace("_", " ") + " (mean over seeds)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{objective.describe()}: {len(done)} configurations")
    fig.savefig(out, dpi=120)
    return out


def heatmap_axes(rows: Sequence[dict[str, Any]], params: Sequence[str]) -> tuple[str, str, str | None] | None:
    """(y, x, panels) for the heatmap of the completed rows, or None: the parameters that vary are two (one
    panel), or three (one panel per value of `nodes` if it varies, else of the one with the fewest values).
    Rows lacking a varying parameter (another part of a union, e.g. DDP beside DiLoCo's outer lr) are left out."""
    rows = [r for r in rows if r["status"] == "completed"]
    while True:
        varying = [p for p in params if len({json.dumps(r.get(p)) for r in rows if r.get(p) is not None}) > 1]
        kept = [r for r in rows if all(r.get(p) is not None for p in varying)]
        if len(kept) == len(rows):
            break
        rows = kept
    if len(varying) == 2:
        return varying[0], varying[1], None
    if len(varying) == 3:
        counts = {p: len({json.dumps(r[p]) for r in rows}) for p in varying}
        panel = "nodes" if "nodes" in varying else min(varying, key=lambda p: counts[p])
        y, x = [p for p in varying if p != panel]
        return y, x, panel
    return None


def _sorted_values(rows: Sequence[dict[str, Any]], p: str) -> list[Any]:
    values = list({json.dumps(r[p]): r[p] for r in rows if r.get(p) is not None}.values())
    try:
        return sorted(values)
    except TypeError:
        return values


def plot_heatmap(rows: Sequence[dict[str, Any]], params: Sequence[str], objective: Objective, out: Path) -> Path | None:
    """The objective's mean (± std) in a cell per pair of values, one panel per value of a third parameter;
    the best cell of each panel boxed. None when the grid is not two (or three) parameters."""
    axes = heatmap_axes(rows, params)
    if axes is None:
        return None
    y, x, panel = axes
    rows = [r for r in rows if r["status"] == "completed" and r.get(x) is not None and r.get(y) is not None
            and r["objective"] is not None]
    panels = _sorted_values(rows, panel) if panel else [None]
    xv, yv = _sorted_values(rows, x), _sorted_values(rows, y)
    finite = [r["objective"] for r in rows if r["objective"] is not None and math.isfinite(r["objective"])]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    fig = _figure(1.2 + 1.1 * len(xv) * len(panels), 1.4 + 0.6 * len(yv))
    cmap = "viridis_r" if objective.direction == "minimize" else "viridis"
    for i, value in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        mine = [r for r in rows if panel is None or r.get(panel) == value]
        grid = [[math.nan] * len(xv) for _ in yv]
        for r in mine:
            grid[yv.index(r[y])][xv.index(r[x])] = r["objective"] if r["objective"] is not None else math.nan
        image = ax.imshow(grid, cmap=cmap, vmin=lo, vmax=hi, aspect="auto")
        best = best_row(mine, objective)
        for r in mine:
            j, k = yv.index(r[y]), xv.index(r[x])
            text = f"{r['objective']:.4f}" + (f"\n±{r['objective_std']:.4f}" if r["objective_std"] is not None else "")
            ax.text(k, j, text, ha="center", va="center", fontsize=7, color="white" if r is not best else "black",
                    bbox=dict(facecolor="white", edgecolor="C3", linewidth=2) if r is best else None)
        ax.set_xticks(range(len(xv)), [str(v) for v in xv])
        ax.set_yticks(range(len(yv)), [str(v) for v in yv])
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.set_title(f"{panel}={value}" if panel else objective.metric)
    fig.colorbar(image, ax=fig.axes, shrink=0.8, label=objective.metric)
    fig.savefig(out, dpi=120)
    return out
