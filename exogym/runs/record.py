"""What a run measured: each node's rows, merged into one row per step for the logger and the record."""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from exogym.runs.timeline import build_timeline
from exogym.runs.trace import write_chrome_trace

if TYPE_CHECKING:
    from exogym.runs.loggers import Logger
    from exogym.runs.progress import RunProgress

__all__ = ["RunRecord", "NodeLog", "LiveLog", "merge_step_rows", "first_non_finite"]


def merge_step_rows(rows: Sequence[dict[str, float]], *, global_batch: int) -> dict[str, float]:
    """One step's rows from several nodes, merged into one row.

    Loss and metrics averaged over the nodes that computed the step (the nodes up), bytes per node (the mean
    over the nodes), tokens and nodes up summed, simulated time the latest, lr and wall time from the lowest
    rank.

    Args:
        rows: The nodes' rows of one step.
        global_batch: Examples per step over all nodes (`examples` is step x this).

    Returns:
        The merged row.
    """
    first = rows[0]
    merged: dict[str, float] = {"step": first["step"]}
    for key in dict.fromkeys(k for r in rows for k in r):
        if key not in ("step", "lr", "bytes", "tokens", "wall_time_s", "sim_time_s", "up"):
            values = [r[key] for r in rows if key in r]  # a node that sat out the step has no loss or metrics
            merged[key] = sum(values) / len(values)
    merged.update(lr=first["lr"], examples=first["step"] * global_batch)
    if "tokens" in first:
        merged["tokens"] = sum(r["tokens"] for r in rows)
    if "up" in first:  # failures / elastic pools: how many nodes were up
        merged["nodes_up"] = sum(r["up"] for r in rows)
    merged.update(bytes=sum(r["bytes"] for r in rows) / len(rows), wall_time_s=first["wall_time_s"])
    if "sim_time_s" in first:
        merged["sim_time_s"] = max(r["sim_time_s"] for r in rows)  # the cluster is as far as its slowest node
    return merged


def first_non_finite(logs: Sequence["NodeLog"]) -> tuple[int, list[int], float] | None:
    """Where a non-finite training loss first appeared.

    Args:
        logs: Every node's log.

    Returns:
        `(step, the nodes with one at that step, the first of their values)`, or None.
    """
    first: dict[int, tuple[int, float]] = {}  # rank -> its first non-finite step and value
    for log in logs:
        for row in log.rows:
            if "loss" in row and not math.isfinite(row["loss"]):
                first[log.rank] = row["step"], row["loss"]
                break
    if not first:
        return None
    step = min(s for s, _ in first.values())
    ranks = sorted(r for r, (s, _) in first.items() if s == step)
    return int(step), ranks, first[ranks[0]][1]


@dataclass
class NodeLog:
    """What one node measured (plain Python, so it can cross processes).

    Args:
        rank: The node.
        rows: One per step: `step` (optimizer steps done, from 1), `loss`, extra metrics, `lr` (used in that
            step), `tokens` (cumulative, for batches of token ids), `bytes` (this node's, cumulative),
            `wall_time_s` (since the run started).
        val: Node 0 only: `step`, `local_` / `global_` loss and metrics.
        diagnostics: Node 0 only: `step`, `param_correlation`, `param_variance`.
        comm: The node's communication counts (bytes per collective, its simulated clock).
    """

    rank: int
    rows: list[dict[str, float]] = field(default_factory=list)
    val: list[dict[str, float]] = field(default_factory=list)
    diagnostics: list[dict[str, float]] = field(default_factory=list)
    comm: dict[str, Any] = field(default_factory=dict)


class LiveLog:
    """Feeds a logger and the progress bar while the run trains.

    A step's merged row (the same row the record keeps) goes out once every node it hears from has reported
    that step (in the sim backend and the spawned torch backend all nodes; in a torchrun process only its own).
    It also keeps every row it was given, so that a run that stops part-way (an exception, a signal, a stuck
    node) still has the record of every step its nodes completed (`partial_logs`).

    Args:
        logger: Where the rows go (None: only the progress bar).
        ranks: The nodes it hears from.
        global_batch: Examples per step over all nodes.
        log_interval: Every log_interval-th step's row goes to the logger, and the last.
        last_step: The run's last step (its row always goes).
        progress: The progress bar, or None.
    """

    def __init__(self, logger: "Logger | None", ranks: Sequence[int], *, global_batch: int, log_interval: int = 1,
                 last_step: int | None = None, progress: "RunProgress | None" = None):
        self.logger, self.global_batch, self.progress = logger, global_batch, progress
        self.log_interval, self.last_step = log_interval, last_step  # every log_interval-th step's row, and the last
        self._queues: dict[int, deque] = {r: deque() for r in ranks}
        self._kept = {r: NodeLog(r) for r in ranks}  # every row received, per node (node 0's log: val, diagnostics)
        self._newest: dict[str, float] | None = None  # the newest merged row, and whether the logger got it
        self._newest_logged = False

    def add_resumed(self, logs: Sequence[NodeLog]) -> None:
        """The rows a resumed run's nodes had before their checkpoint: part of the run, already logged.

        Args:
            logs: The nodes' logs from the checkpoint.
        """
        for log in logs:
            if log.rank in self._kept:
                kept = self._kept[log.rank]
                kept.rows, kept.val, kept.diagnostics = list(log.rows), list(log.val), list(log.diagnostics)

    def fill_resumed(self, loggers: Sequence["Logger"]) -> None:
        """A resumed run whose loggers hold fewer rows than its checkpoint (its process stopped between the
        checkpoint and the rows' flush): each logger gets the rows it misses up to the checkpoint's step, from the
        rows the checkpoint carries.

        Args:
            loggers: The run's loggers; each one's `written_through` says where it stands (None: left alone).
        """
        logs = self.partial_logs()
        train = [merge_step_rows(rows, global_batch=self.global_batch) for rows in zip(*(l.rows for l in logs))]
        for logger in loggers:
            for table, rows in (("train", train), ("val", logs[0].val if logs else [])):
                through = getattr(logger, "written_through", lambda _: None)(table)
                if through is None:
                    continue
                for row in rows:
                    step = int(row["step"])
                    if step > through and (table == "val" or step % self.log_interval == 0
                                           or step == self.last_step):
                        logger.log(table, row)

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None:
        """Node `rank`'s newest rows; a step whose rows every node has sent goes out merged.

        Args:
            rank: The node.
            rows: Its rows, in step order.
        """
        if rank not in self._queues:
            return
        self._kept[rank].rows.extend(rows)
        if self.logger is None and self.progress is None:
            return
        self._queues[rank].extend(rows)
        while all(self._queues.values()):
            row = merge_step_rows([q.popleft() for q in self._queues.values()], global_batch=self.global_batch)
            step = int(row["step"])
            self._newest, self._newest_logged = row, False
            if self.logger is not None and (step % self.log_interval == 0 or step == self.last_step):
                self._newest_logged = True
                self.logger.log("train", row)
            if self.progress is not None:
                self.progress.train_row(row)

    def add_row(self, table: str, row: dict[str, float]) -> None:
        """A row only node 0 measures (`"val"`, `"diagnostics"`).

        Args:
            table: `"val"` or `"diagnostics"`.
            row: The row.
        """
        first = self._kept[min(self._kept)]
        (first.val if table == "val" else first.diagnostics).append(row)
        if self.logger is not None:
            self.logger.log(table, row)
        if self.progress is not None and table == "val":
            self.progress.val_row(row)

    def note_peak_rss(self, rank: int, mb: float) -> None:
        """The peak resident memory of node `rank`'s process, which it reported as it failed (the record of a run
        that stopped part-way covers every process that could say).

        Args:
            rank: The first node of the process.
            mb: Its peak, in MB.
        """
        if rank in self._kept:
            self._kept[rank].comm["process_peak_rss_mb"] = mb

    def log_newest_row(self) -> None:
        """The run stopped part-way: the newest step's row goes to the logger too, when log_interval skipped it (a
        completed run's last row always goes)."""
        if self.logger is not None and self._newest is not None and not self._newest_logged:
            self._newest_logged = True
            self.logger.log("train", self._newest)

    def rows_of(self, rank: int) -> list[dict[str, float]]:
        """Every row node `rank` reported (the rows of a node in another process, which sends them only here).

        Args:
            rank: The node.

        Returns:
            Its rows.
        """
        return self._kept[rank].rows

    def partial_logs(self) -> list[NodeLog]:
        """Every node's rows as received so far (a record of the steps every node completed: RunRecord.from_nodes
        keeps the steps all of them reported)."""
        return [self._kept[r] for r in sorted(self._kept)]


@dataclass
class RunRecord:
    """The measurements of a finished run, on `trainer.record`.

    Also on the exception of a run that stopped part-way (`e.record`), holding every step all nodes completed.
    The same rows are in the run folder's `train.csv`, `val.csv` and `summary.json`.

    Attributes:
        config: The run's configuration, as `config.json` holds it.
        train: One row per step: `step`, `loss` (mean over the nodes up), extra metrics (likewise), `lr`,
            `examples` (global), `tokens` (global, when batches hold token ids), `bytes` (sent per node,
            cumulative: the mean over the nodes; `total_bytes` is the sum), `wall_time_s`, and `sim_time_s`
            (the latest node's virtual clock) when the run has a time model; `nodes_up` with failures or an
            elastic pool.
        val: One row per evaluation (at step 0, every `val_interval` steps and at the end): `step`,
            `local_loss` (node 0's model), `global_loss` (the global model), and `local_` / `global_`
            versions of every extra metric.
        diagnostics: Rows of `step`, `param_correlation`, `param_variance` (fit's `diagnostics_interval`).
        node_loss: `node_loss[r][s]` is node r's training loss at step s+1 (nan where it sat out the step); in
            the record of a run that stopped part-way, each node's list holds the steps it completed, which
            `train` (the steps every node completed) may not all hold.
        bytes_per_node: `bytes_per_node[r]` is the wire bytes node r sent in total (ring algorithms: an
            all-reduce of N bytes costs 2 N (R-1)/R, an all-gathered chunk n costs n (R-1)); also as
            `wire_bytes_per_node`.
        comm_per_node: Per node, its communication counts (bytes per collective, payload bytes, and its
            simulated clock under `sim_time`); over several processes of the sim backend, `process_waited_s`:
            the wall seconds its process had no node to run while it waited on the other processes.
        wall_time_s: The run's wall-clock seconds.
        peak_memory_mb: Peak memory in MB: the calling process's resident memory (`process_rss`), the whole
            run's over every process (`run_rss`) and, over several processes, each one's (`per_process_rss`);
            per CUDA device, its peak allocation.
    """

    config: dict[str, Any]
    train: list[dict[str, float]]
    val: list[dict[str, float]]
    diagnostics: list[dict[str, float]]
    node_loss: list[list[float]]
    bytes_per_node: list[int]
    comm_per_node: list[dict[str, Any]]
    wall_time_s: float
    peak_memory_mb: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_nodes(cls, logs: list[NodeLog], *, config: dict[str, Any], global_batch: int,
                   wall_time_s: float, peak_memory_mb: dict[str, float] | None = None) -> "RunRecord":
        """The record of a run from its nodes' logs: one row per step every node completed.

        Args:
            logs: Every node's NodeLog, in rank order.
            config: The run's configuration.
            global_batch: Examples per step over all nodes (a row's `examples` is step x this).
            wall_time_s: The run's wall-clock seconds.
            peak_memory_mb: The peak memory, if measured.

        Returns:
            The RunRecord.
        """
        # zip: a run that stopped part-way has the steps every node completed; node_loss keeps each node's own
        train = [merge_step_rows(step_rows, global_batch=global_batch) for step_rows in zip(*(l.rows for l in logs))]
        return cls(config=config, train=train, val=logs[0].val, diagnostics=logs[0].diagnostics,
                   node_loss=[[row.get("loss", math.nan) for row in log.rows] for log in logs],
                   bytes_per_node=[int(log.rows[-1]["bytes"]) if log.rows else 0 for log in logs],
                   comm_per_node=[log.comm for log in logs], wall_time_s=wall_time_s,
                   peak_memory_mb=peak_memory_mb or {})

    def column(self, name: str, table: str = "train") -> list[float]:
        """One column of the `"train"`, `"val"` or `"diagnostics"` rows.

        Args:
            name: The column, e.g. `"loss"`, `"global_loss"`, `"bytes"`.
            table: `"train"`, `"val"` or `"diagnostics"`.

        Returns:
            The column's values, one per row.

        Raises:
            KeyError: No such column (listing the table's columns).
        """
        rows = {"train": self.train, "val": self.val, "diagnostics": self.diagnostics}[table]
        if rows and name not in rows[0]:
            raise KeyError(f"no column {name!r} in the {table} rows; columns are {list(rows[0])}")
        return [row[name] for row in rows]

    @property
    def wire_bytes_per_node(self) -> list[int]:
        """The same as `bytes_per_node`: the wire bytes each node sent in total."""
        return self.bytes_per_node

    @property
    def payload_bytes_per_node(self) -> list[int]:
        """Per node, its own data put on the wire, each byte counted once.

        The papers' convention: an all-reduce or all-gather of N bytes is N, whatever the group size.
        """
        return [int(c.get("payload_bytes", 0)) for c in self.comm_per_node]

    @property
    def total_bytes(self) -> int:
        """The wire bytes all nodes sent, summed."""
        return sum(self.bytes_per_node)

    @property
    def sim_time_per_node(self) -> list[dict[str, float]]:
        """Per node: simulated seconds in total (now) and spent computing, communicating and waiting."""
        return [c["sim_time"] for c in self.comm_per_node if "sim_time" in c]

    @property
    def sim_time_s(self) -> float | None:
        """The run's simulated wall-clock: when its last node finished (None without a time model)."""
        clocks = self.sim_time_per_node
        return max(c["now"] for c in clocks) if clocks else None

    @property
    def updates(self) -> list[dict[str, float]]:
        """One row per update a strategy's server applied (asynchronous strategies): sim_time_s (when it was
        applied), node, staleness (server updates since the node's model was sent to it), weight, and what else
        applies (quorum size, tokens); [] without a server."""
        server = self.comm_per_node[0].get("server") if self.comm_per_node else None
        return list(server["updates"]) if server else []

    @property
    def links(self) -> dict[str, dict[str, float]]:
        """Per directed link of the simulated network (`"server down"`, `"port 3 up"`, `"wan 0>1"`, ...: the names of
        exogym.cluster.network), `busy_s` (simulated seconds it carried at least one transfer) and `bytes` (what the
        transfers put on it); {} without a network of shared links (`Network(shared_links=False)`) or messages."""
        links = self.comm_per_node[0].get("links") if self.comm_per_node else None
        return {name: dict(links[name]) for name in sorted(links)} if links else {}

    @property
    def slowdowns(self) -> list[dict[str, float]]:
        """The transient slowdowns (fit's `slowdowns`) that started while the nodes ran, in time order: node,
        from_s, to_s (simulated seconds) and factor; [] without slowdowns."""
        rows = [row for c in self.comm_per_node for row in c.get("slowdowns", ())]
        return sorted(rows, key=lambda r: (r["from_s"], r["node"]))

    @property
    def time_per_node(self) -> list[dict[str, float]]:
        """Per node, its simulated seconds: compute_s, comm_s (transfers), idle_s (waiting for others or for
        messages, and after it finished until the run's end), total_s (the run's simulated wall-clock) and, with
        slowdowns, slowed_s (what they added to its compute)."""
        end = self.sim_time_s
        out = []
        for c in self.sim_time_per_node:
            idle = c["wait_s"] + (end - c["now"])
            out.append({"compute_s": c["compute_s"], "comm_s": c["comm_s"], "idle_s": idle, "total_s": end,
                        **({"slowed_s": c["slowed_s"]} if "slowed_s" in c else {})})
        return out

    @property
    def goodput(self) -> float | None:
        """Useful compute over the nodes' total simulated time: the sum of the nodes' compute seconds over
        K x the run's simulated wall-clock (None without a time model). What slowdowns added (slowed_s) is not
        useful compute."""
        times = self.time_per_node
        if not times or not times[0]["total_s"]:
            return None
        return sum(t["compute_s"] for t in times) / (len(times) * times[0]["total_s"])

    @property
    def timeline(self) -> dict[str, Any] | None:
        """Where each node's simulated seconds went: lanes of compute, comm, idle, down and slowed spans, the
        messages and the server's updates (exogym.runs.timeline's format; the run folder's timeline.json); None
        without a time model."""
        return build_timeline(self.comm_per_node, slowdowns=self.slowdowns)

    def export_trace(self, path: str | os.PathLike) -> Path:
        """Write the run's timeline as a Chrome trace event file (Perfetto, chrome://tracing).

        Args:
            path: The file to write.

        Returns:
            Its path.

        Raises:
            ValueError: The run has no timeline (it ran without simulated time: give fit a network=).
        """
        timeline = self.timeline
        if timeline is None:
            raise ValueError("this run has no timeline: spans are recorded in simulated time, so give fit a network= "
                             "and run again")
        return write_chrome_trace(timeline, path)

    def summary(self) -> dict[str, Any]:
        """The headline numbers (what summary.json holds; `timeline` goes to its own file, timeline.json)."""
        last_val = self.val[-1] if self.val else {}
        return {"steps": len(self.train), "final_train_loss": self.train[-1].get("loss") if self.train else None,  # none: every node sat out
                **{f"final_{k}": v for k, v in last_val.items() if k != "step"},
                "bytes_per_node": self.bytes_per_node, "total_bytes": self.total_bytes,
                "wire_bytes_per_node": self.bytes_per_node, "payload_bytes_per_node": self.payload_bytes_per_node,
                "bytes_convention": "wire: what the ring algorithms send per node (all-reduce 2N(R-1)/R, all-gather "
                                    "n(R-1)); payload: each node's own data put on the wire once (the papers' count)",
                "wall_time_s": self.wall_time_s, "sim_time_s": self.sim_time_s,
                "sim_time_per_node": self.sim_time_per_node, "goodput": self.goodput,
                "updates_applied": len(self.updates), "peak_memory_mb": self.peak_memory_mb,
                **({"links": self.links} if self.links else {}),
                **({"slowdowns": self.slowdowns} if any("slowdowns" in c for c in self.comm_per_node) else {}),
                "comm_per_node": [{k: v for k, v in c.items() if k not in ("timeline", "link_spans")}
                                  for c in self.comm_per_node],
                **({"timeline": timeline} if (timeline := self.timeline) is not None else {})}
