"""Compare runs' curves: loss (or any recorded column) against steps, examples, tokens, bytes or time.

    from exogym.runs.plot import plot_runs
    plot_runs(["logs/ddp-4n-...", trainer.record], x="bytes", y="global_loss", out="loss_vs_bytes.png")

Needs matplotlib (`pip install 'exogym[plot]'`). Runs are run folders written by CSVLogger or
RunRecord objects.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

from exogym.runs.record import RunRecord

__all__ = ["RunCurves", "load_run", "plot_runs", "X_AXES"]

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1)), (0, (3, 1, 1, 1, 1, 1)))

X_AXES = ("step", "examples", "tokens", "bytes", "wall_time_s", "sim_time_s", "updates", "local_steps")
_X_LABELS = {"step": "step", "examples": "examples seen", "tokens": "tokens seen",
             "bytes": "bytes sent per node", "wall_time_s": "wall-clock seconds", "sim_time_s": "simulated seconds",
             "updates": "server updates applied", "local_steps": "total local updates (inner steps, all nodes)"}


@dataclass
class RunCurves:
    """A run's rows, from a run folder or a RunRecord.

    Args:
        label: The run's name in the legend.
        train: Its `train` rows.
        val: Its `val` rows.
        num_nodes: Its node count (for the local_steps axis of a run without a server), if known.
    """

    label: str
    train: list[dict[str, float]]
    val: list[dict[str, float]]
    num_nodes: int | None = None


def _read_rows(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def load_run(run: Union[str, os.PathLike, RunRecord], label: str | None = None) -> RunCurves:
    """A run's rows from its run folder (`train.csv`, `val.csv`) or its RunRecord.

    Args:
        run: A run folder or a RunRecord.
        label: The name in the legend; default: the folder's name (or the record's run name, else its strategy).

    Returns:
        The RunCurves.

    Raises:
        FileNotFoundError: The folder has no `train.csv`.
    """
    if isinstance(run, RunRecord):
        name = label or run.config.get("run_name") or run.config.get("strategy", "run")
        return RunCurves(name, run.train, run.val, run.config.get("num_nodes"))
    folder = Path(run)
    if not (folder / "train.csv").exists():
        raise FileNotFoundError(f"{str(folder)!r} is not a run folder: it has no train.csv "
                                "(CSVLogger writes logs/<run_name>/train.csv)")
    name = label or folder.name  # the name the user gave the folder (config's run_name may be a default)
    config = folder / "config.json"
    num_nodes = json.loads(config.read_text()).get("num_nodes") if config.exists() else None
    return RunCurves(name, _read_rows(folder / "train.csv"), _read_rows(folder / "val.csv"), num_nodes)


def _series(run: RunCurves, x: str, y: str) -> tuple[list[float], list[float]]:
    """(xs, ys) for column y: validation columns are placed at the train row of the same step."""
    by_step = {int(row["step"]): row for row in run.train}
    if run.train:  # the step-0 evaluation (the initial model): nothing trained, seen, sent or spent yet
        by_step.setdefault(0, {k: 0.0 for k in run.train[0]})
    if run.train and y in run.train[0]:
        rows = run.train
    elif run.val and y in run.val[0]:
        rows = run.val
    else:
        columns = sorted(set(run.train[0] if run.train else {}) | set(run.val[0] if run.val else {}))
        raise KeyError(f"run {run.label!r} has no column {y!r}; it has {columns}")
    if rows is run.val and x in rows[0]:  # a validation row that says where it was taken (a server's strategies)
        return [r[x] for r in rows], [r[y] for r in rows]
    if x == "local_steps" and run.train and x not in run.train[0]:
        by_step = _with_local_steps(run, by_step)
    if run.train and x not in run.train[0] and x not in by_step.get(int(run.train[0]["step"]), {}):
        raise KeyError(f"run {run.label!r} has no x column {x!r}; choose one of "
                       f"{[a for a in X_AXES if a in run.train[0]]}")
    points = [(by_step[int(r["step"])][x], r[y]) for r in rows if int(r["step"]) in by_step]
    return [p[0] for p in points], [p[1] for p in points]


def _with_local_steps(run: RunCurves, by_step: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The train rows with `local_steps`, the inner steps taken by all nodes so far, for a run whose validation rows
    do not say (no server): every node up takes every step (nodes_up under failures, else num_nodes)."""
    if run.num_nodes is None and "nodes_up" not in run.train[0]:
        raise KeyError(f"run {run.label!r} does not say its node count (config.json's num_nodes), which the "
                       "local_steps axis of a run without a server counts from")
    out, total = {0: {**by_step[0], "local_steps": 0.0}}, 0.0
    for row in run.train:
        total += row.get("nodes_up", run.num_nodes)
        out[int(row["step"])] = {**row, "local_steps": total}
    return out


def plot_runs(runs: Sequence[Union[str, os.PathLike, RunRecord, RunCurves]], *, x: str = "step",
              y: str = "global_loss", out: str | os.PathLike = "comparison.png", labels: Sequence[str] | None = None,
              title: str | None = None, log_x: bool | None = None) -> Path:
    """Draw `y` against `x` for every run on one axes and save a PNG.

    Each run gets its own marker and dash pattern, curves start at the step-0 evaluation, and the legend shows
    the run folders' names (or `labels`).

    Args:
        runs: Run folders, RunRecords or RunCurves.
        x: The x-axis, one of `X_AXES`: step, examples, tokens, bytes (per node), wall_time_s, sim_time_s,
            updates (a server's), local_steps (the inner steps of all nodes: as applied by the server, for the
            server's strategies; every node up at every step, for the others).
        y: A train or val column, e.g. `"global_loss"`, `"loss"`.
        out: The PNG's path.
        labels: One legend label per run.
        title: The plot's title.
        log_x: A logarithmic x-axis; default: only for `x="bytes"`.

    Returns:
        The PNG's path.

    Raises:
        ValueError: An unknown `x`, or not one label per run.
        KeyError: A run has no such column.
        ImportError: matplotlib is not installed.
    """
    if x not in X_AXES:
        raise ValueError(f"x must be one of {list(X_AXES)}, got {x!r}")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'exogym[plot]'") from e
    curves = [r if isinstance(r, RunCurves) else load_run(r, labels[i] if labels else None)
              for i, r in enumerate(runs)]
    fig = Figure(figsize=(7, 4.5), layout="constrained")  # no pyplot: no global state, works headless
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    log = log_x if log_x is not None else x == "bytes"
    for i, run in enumerate(curves):
        xs, ys = _series(run, x, y)
        if log:  # a log axis cannot show x = 0 (e.g. an evaluation before DiLoCo's first sync)
            xs, ys = zip(*[(a, b) for a, b in zip(xs, ys) if a > 0]) if any(a > 0 for a in xs) else ((), ())
        # Each run its own marker and dash pattern, so a curve lying on another still shows.
        ax.plot(xs, ys, label=run.label, marker=_MARKERS[i % len(_MARKERS)], markersize=5, fillstyle="none",
                linestyle=_DASHES[i % len(_DASHES)], linewidth=1.4, markevery=max(1, len(xs) // 12), alpha=0.9)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(_X_LABELS[x])
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title or f"{y.replace('_', ' ')} vs {_X_LABELS[x]}")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out
