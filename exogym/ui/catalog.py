"""What `exogym ui` reads under its root: the run folders and sweep folders, each run's status and headline numbers,
its rows and its timeline; and the one rule for a name a request gives (`resolve_inside`).

Only files are read: the view adds nothing to a run's own time. A run folder is a folder holding the marker
`.exogym-run` or the files of a run (exogym.runs.rerun.RUN_FILES); a sweep folder holds `sweep.json`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, Iterator

from exogym.runs.marker import MARKER, holder_running, parse_marker
from exogym.runs.rerun import RUN_FILES
from exogym.runs.timeline import TIMELINE_FILE

__all__ = ["UnsafePath", "resolve_inside", "find_folders", "run_entry", "run_rows", "sweep_entry", "read_json",
           "MAX_DEPTH"]

MAX_DEPTH = 4  # root/sweep/runs/<run>/ is three deep; a run folder's own subfolders (checkpoints) are not runs
_SKIP = {"checkpoints", "__pycache__", ".git", "node_modules"}


class UnsafePath(ValueError):
    """A name that would read outside the served root (an absolute path, `..`, a symbolic link out)."""


def resolve_inside(root: Path, name: str) -> Path:
    """The folder `name` names under `root`, refused unless it stays inside it.

    Args:
        root: The served root (resolved).
        name: A path relative to the root, with `/` between its parts.

    Returns:
        The resolved folder.

    Raises:
        UnsafePath: `name` is absolute, holds `..`, a backslash or a NUL, or resolves (through a symbolic link)
            outside the root.
    """
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise UnsafePath(f"not a folder name under the served root: {name!r}")
    if name.startswith("/") or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafePath(f"absolute paths are refused; name a folder under the served root: {name!r}")
    parts = name.split("/")
    if any(p in ("..", "") for p in parts):
        raise UnsafePath(f"'..' and empty parts are refused: {name!r}")
    path = (root / name).resolve()
    if path != root and root not in path.parents:
        raise UnsafePath(f"{name!r} leads outside the served root (a symbolic link out)")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _is_run(folder: Path, names: set[str]) -> bool:
    return MARKER in names or any(f in names for f in RUN_FILES)


def find_folders(root: Path) -> Iterator[tuple[str, str]]:
    """Every run folder and sweep folder under `root` (not following symbolic links), as (kind, name).

    Args:
        root: The served root (resolved).

    Yields:
        ("run" or "sweep", the folder's path relative to the root, with `/`).
    """
    stack = [(root, 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        names = {e.name for e in entries}
        rel = folder.relative_to(root).as_posix()
        if folder != root and _is_run(folder, names):
            yield "run", rel
            continue
        if "sweep.json" in names:
            yield "sweep", rel
        if depth < MAX_DEPTH:
            subs = [Path(e.path) for e in entries
                    if e.is_dir(follow_symlinks=False) and e.name not in _SKIP and not e.name.startswith(".")]
            stack.extend((s, depth + 1) for s in sorted(subs, reverse=True))


def _last_csv_row(path: Path) -> tuple[dict[str, str], int]:
    """The last row of a CSV (as strings) and how many rows it has, reading the file once."""
    try:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            last, n = None, 0
            for last in reader:
                n += 1
    except OSError:
        return {}, 0
    if header is None or last is None:
        return {}, 0
    return dict(zip(header, last)), n


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _status(marker: dict[str, Any], summary: dict[str, Any]) -> tuple[str, str | None]:
    """The run's status (running, completed, failed, interrupted, stuck) and what it says of its ending."""
    status = summary.get("status") or marker.get("status") or "unknown"
    if marker.get("status") == "running":
        if holder_running(marker):
            return "running", None
        return "interrupted", "its process ended without recording how (killed, or out of memory)"
    if status == "failed" and summary.get("stuck"):
        return "stuck", summary.get("error")
    if status == "failed":
        return "failed", summary.get("error") or marker.get("reason")
    if status == "interrupted":
        return "interrupted", f"signal {summary.get('signal')}; resume from {summary.get('resume_from')}"
    return status, None


def _mean(value: Any) -> float | None:
    if isinstance(value, list) and value:
        return sum(value) / len(value)
    return _number(value)


def run_entry(root: Path, name: str) -> dict[str, Any]:
    """One row of the runs list: what the run's files say of it.

    Args:
        root: The served root (resolved).
        name: The run folder, relative to the root.

    Returns:
        name, strategy, nodes, status, error, steps, the final losses, bytes per node, simulated seconds, when it
        started, whether it has a timeline, and its sweep (the folder above `runs/`, if any).
    """
    folder = root / name
    config, summary = read_json(folder / "config.json"), read_json(folder / "summary.json")
    try:
        marker = parse_marker((folder / MARKER).read_text())
    except OSError:
        marker = {}
    status, error = _status(marker, summary)
    entry: dict[str, Any] = {
        "name": name, "strategy": config.get("strategy"), "nodes": config.get("num_nodes"), "status": status,
        "error": error, "started": marker.get("started"), "ended": marker.get("time") if status != "running" else None,
        "steps": summary.get("steps"), "max_steps": config.get("max_steps"),
        "train_loss": _number(summary.get("final_train_loss")), "val_loss": _number(summary.get("final_global_loss")),
        "bytes_per_node": _mean(summary.get("bytes_per_node")), "sim_time_s": _number(summary.get("sim_time_s")),
        "goodput": _number(summary.get("goodput")), "updates": summary.get("updates_applied"),
        "timeline": (folder / TIMELINE_FILE).is_file(),
        "sweep": name.rsplit("/runs/", 1)[0] if "/runs/" in name else None,
    }
    if not summary:  # running, or ended without a summary: the rows say how far it got
        last, n = _last_csv_row(folder / "train.csv")
        entry.update(steps=_number(last.get("step")) if last else 0, train_loss=_number(last.get("loss")),
                     bytes_per_node=_number(last.get("bytes")), sim_time_s=_number(last.get("sim_time_s")))
    return entry


def run_rows(folder: Path, table: str, since: int = 0) -> dict[str, list[float | None]]:
    """A run's `train.csv` or `val.csv` as columns, from row `since` on (a live view asks for what it lacks).

    Args:
        folder: The run folder (resolved inside the root).
        table: "train" or "val".
        since: How many rows the caller already has.

    Returns:
        {column: values}, numbers (None for an empty or non-numeric cell).
    """
    path = folder / f"{table}.csv"
    if table == "val" and not path.is_file():
        path = folder / "validation.csv"  # the original EXO Gym's name
    try:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None) or []
            columns: dict[str, list[float | None]] = {c: [] for c in header}
            for i, row in enumerate(reader):
                if i < since or len(row) != len(header):  # a row being written has fewer cells: next time
                    continue
                for c, cell in zip(header, row):
                    columns[c].append(_number(cell))
    except OSError:
        return {}
    return columns


def sweep_entry(root: Path, name: str) -> dict[str, Any]:
    """A sweep folder: its definition and its results table (results.csv), as written by `exogym sweep`.

    Args:
        root: The served root (resolved).
        name: The sweep folder, relative to the root.

    Returns:
        name, the definition (sweep.json), the table's columns and rows (strings as written).
    """
    folder = root / name
    rows: list[dict[str, str]] = []
    try:
        with open(folder / "results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        pass
    return {"name": name, "definition": read_json(folder / "sweep.json"), "columns": list(rows[0]) if rows else [],
            "rows": rows}
