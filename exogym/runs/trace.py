"""A run's timeline as a Chrome trace event file, for Perfetto (ui.perfetto.dev, its trace processor) and the
readers of that format.

One process ("simulated cluster"), one thread per lane (node 0, node 1, ..., the server, then the shared links'
lanes) named by metadata events; each span is a complete event ("ph": "X") named by its kind with its
step in args (a link's: the most flows on it at once, as "flows"); each message is an async slice
("ph": "b" / "e", category "message") from its send to its arrival, on the sending lane; each server update an
instant event ("ph": "i") on the server's lane with the node and staleness. Times are simulated microseconds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

__all__ = ["chrome_trace_events", "write_chrome_trace"]

_PID = 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace_events(timeline: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """The trace events of a timeline (exogym.runs.timeline's format), one dict at a time.

    Args:
        timeline: The run's timeline.

    Yields:
        Chrome trace events.
    """
    kinds, lanes = timeline["kinds"], timeline["lanes"]
    yield {"ph": "M", "pid": _PID, "name": "process_name", "args": {"name": "simulated cluster"}}
    for tid, lane in enumerate(lanes):
        yield {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": lane["name"]}}
        yield {"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}}
        t = lane["t"]
        arg, values = ("flows", lane["flows"]) if lane["kind"] == "link" else ("step", lane["steps"])
        for i, k in enumerate(lane["kinds"]):
            yield {"ph": "X", "pid": _PID, "tid": tid, "name": kinds[k], "cat": kinds[k], "ts": _us(t[i]),
                   "dur": _us(t[i + 1]) - _us(t[i]), "args": {arg: values[i]}}
    m = timeline["messages"]
    for i in range(len(m["src"])):
        src, dst = m["src"][i], m["dst"][i]
        name = f"{lanes[src]['name']} -> {lanes[dst]['name'] if dst >= 0 else '?'}"
        common = {"pid": _PID, "tid": src, "cat": "message", "name": name, "id": i}
        yield {**common, "ph": "b", "ts": _us(m["sent"][i]), "args": {"bytes": m["bytes"][i], "step": m["step"][i]}}
        yield {**common, "ph": "e", "ts": _us(m["arrives"][i])}
    u = timeline["updates"]
    server = next((i for i, lane in enumerate(lanes) if lane["kind"] == "server"), None)
    for i in range(len(u["t"])):
        node = lanes[u["lane"][i]]["name"] if u["lane"][i] >= 0 else "?"
        yield {"ph": "i", "s": "t", "pid": _PID, "tid": server if server is not None else 0, "name": "update",
               "cat": "update", "ts": _us(u["t"][i]), "args": {"node": node, "staleness": u["staleness"][i]}}


def write_chrome_trace(timeline: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write a timeline as a Chrome trace event file (JSON object format, `traceEvents`).

    Args:
        timeline: The run's timeline (exogym.runs.timeline's format).
        path: Where to write it (its folder must exist).

    Returns:
        The file's path.
    """
    path = Path(path)
    with open(path, "w") as f:
        f.write('{"displayTimeUnit":"ms","otherData":{"clock":"simulated seconds, as microseconds"},"traceEvents":[\n')
        first = True
        for event in chrome_trace_events(timeline):
            f.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":")))
            first = False
        f.write("\n]}\n")
    return path
