"""A run's timeline: lanes of spans in simulated time, the messages between lanes and the server's updates.

Built from the nodes' span logs (exogym.cluster.spans, in each node's record under "timeline") and the server's
record; written to the run folder as `timeline.json` (one file for the whole run, never one per step) and read back
by `exogym ui` and `exogym trace` (exogym.runs.trace).

The format (`"format": 1`):

- `lanes`: one per node (`"kind": "node"`, `"rank"`), then the server (`"kind": "server"`) when the run had one;
  a lane has `t` (span boundaries, seconds), `kinds` (one letter a span: SPAN_KINDS) and `steps` (the step each span
  began in). A lane with no spans (the server's) has `t` of one value. Then the links that carried a flow on a
  network of shared links (`"kind": "link"`, named as exogym.cluster.network names links), a lane per busy pattern:
  its spans are busy ("b": at least one flow crossed it) and idle ("i"), from 0 to the end of its last busy span, with
  `flows` (the most flows on it at once in each span; 0 when idle) in place of `steps`, and `links` (the links whose
  spans these are, in name order). Links whose spans are the same to the bit share one lane, named by the first with
  the count of the others (a collective's ring keeps every port it occupies busy alike: a DDP run of K nodes has one
  such lane, not 2K); lanes are in the order of their first link's name.
- `messages`: columns `src`, `dst` (lane indices), `sent`, `arrives` (seconds), `bytes`, `step` (the sender's).
- `updates`: columns `t`, `lane` (the node whose update it was, as a lane index), `staleness`.
- `slowdowns`: the record's rows (node, from_s, to_s, factor).
- `end_s`: the run's simulated wall-clock.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from exogym.cluster.spans import MESSAGE_COLUMNS, SPAN_KINDS
from exogym.runs.disk import write_text

__all__ = ["build_timeline", "write_timeline", "read_timeline", "TIMELINE_FILE", "SPAN_KINDS", "LANE_KINDS"]

TIMELINE_FILE = "timeline.json"
FORMAT = 1
_SERVER = -1
LANE_KINDS = {**SPAN_KINDS, "b": "busy"}  # the nodes' kinds and a link's busy time (its idle time is "i")


def build_timeline(comm_per_node: Sequence[Mapping[str, Any]], *,
                   slowdowns: Sequence[Mapping[str, float]] = ()) -> dict[str, Any] | None:
    """The run's timeline from its nodes' communication records.

    Args:
        comm_per_node: The record's `comm_per_node` (each node's `timeline`; node 0's `server` and `link_spans`).
        slowdowns: The record's transient slowdowns.

    Returns:
        The timeline (the module's format), or None when the run recorded no spans (no time model).
    """
    if not comm_per_node or any("timeline" not in c for c in comm_per_node):
        return None
    server = comm_per_node[0].get("server")
    lanes: list[dict[str, Any]] = []
    for rank, c in enumerate(comm_per_node):
        spans = c["timeline"]
        lanes.append({"name": f"node {rank}", "kind": "node", "rank": rank, "t": list(spans["t"]),
                      "kinds": spans["kinds"], "steps": list(spans["steps"])})
    end = max(lane["t"][-1] for lane in lanes)
    if server is not None:
        lanes.append({"name": "server", "kind": "server", "t": [0.0], "kinds": "", "steps": []})
    lanes += _link_lanes(comm_per_node[0].get("link_spans") or {})
    lane_of = {rank: rank for rank in range(len(comm_per_node))}
    if server is not None:
        lane_of[_SERVER] = len(comm_per_node)
    messages: dict[str, list[float]] = {"src": [], **{c: [] for c in MESSAGE_COLUMNS}}
    senders = [(rank, c["timeline"]["messages"]) for rank, c in enumerate(comm_per_node)]
    if server is not None and "messages" in server:
        senders.append((_SERVER, server["messages"]))
    for src, sent in senders:
        # (shared links: a message's arrival is nan in its sender's log until its flow ends; one still unknown when
        # the log was kept, e.g. a process other than node 0's across a checkpoint, has no arrow)
        keep = [i for i, at in enumerate(sent["arrives"]) if at == at]
        messages["src"] += [lane_of[src]] * len(keep)
        messages["dst"] += [lane_of.get(int(sent["dst"][i]), -1) for i in keep]
        for column in ("sent", "arrives"):
            messages[column] += [sent[column][i] for i in keep]
        messages["bytes"] += [int(sent["bytes"][i]) for i in keep]
        messages["step"] += [int(sent["step"][i]) for i in keep]
    updates: dict[str, list[float]] = {"t": [], "lane": [], "staleness": []}
    for row in (server or {}).get("updates", ()):
        updates["t"].append(row["sim_time_s"])
        updates["lane"].append(lane_of.get(int(row.get("node", _SERVER)), lane_of.get(_SERVER, -1)))
        updates["staleness"].append(row.get("staleness", 0))
    end = max([end, *messages["arrives"]])
    return {"format": FORMAT, "kinds": LANE_KINDS, "end_s": end, "lanes": lanes, "messages": messages,
            "updates": updates, "slowdowns": [dict(s) for s in slowdowns]}


def _link_lanes(spans: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A lane per busy pattern of the links (module docstring): links with the same spans share one."""
    alike: dict[tuple, list[str]] = {}
    for name in sorted(spans):
        pattern = (tuple(spans[name]["t"]), spans[name]["kinds"], tuple(spans[name]["flows"]))
        alike.setdefault(pattern, []).append(name)
    return [{"name": names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1}", "kind": "link",
             "t": list(t), "kinds": kinds, "flows": list(flows), "links": names}
            for (t, kinds, flows), names in alike.items()]


def write_timeline(folder: str | os.PathLike, timeline: Mapping[str, Any]) -> Path:
    """Write `timeline.json` into a run folder (whole or not at all, as every run file).

    Args:
        folder: The run folder.
        timeline: What `build_timeline` returned.

    Returns:
        The file's path.
    """
    path = Path(folder) / TIMELINE_FILE
    write_text(path, json.dumps(timeline, separators=(",", ":")) + "\n", "the run's timeline")
    return path


def read_timeline(folder: str | os.PathLike) -> dict[str, Any]:
    """Read a run folder's `timeline.json`.

    Args:
        folder: The run folder.

    Returns:
        The timeline (the module's format).

    Raises:
        FileNotFoundError: The run has no timeline (it ran without simulated time, or has not completed), saying so.
        ValueError: The file is not a timeline of a format this version reads.
    """
    path = Path(folder) / TIMELINE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist: a run has a timeline once it completed, and only "
                                "when it ran with simulated time (fit's network=)")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a timeline of format {FORMAT} (got format "
                         f"{data.get('format') if isinstance(data, dict) else None!r})")
    return data
