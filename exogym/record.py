"""The run record: what a run measured, kept on the trainer after `fit` (`trainer.record`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunRecord", "NodeLog"]


@dataclass
class NodeLog:
    """What one node measured, returned by its loop (plain Python, so it can cross processes)."""

    rank: int
    loss: list[float] = field(default_factory=list)            # per step
    metrics: dict[str, list[float]] = field(default_factory=dict)  # extra scalars the model returned, per step
    lr: list[float] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)        # cumulative, per step
    wall_time_s: list[float] = field(default_factory=list)     # since the run started, per step
    val: list[dict[str, float]] = field(default_factory=list)  # node 0 only: rows of validation results
    comm: dict[str, Any] = field(default_factory=dict)         # CommStats at the end


@dataclass
class RunRecord:
    """Per-step training rows (losses averaged over nodes), validation rows, and bytes per node.

    train rows: step (1-based: optimizer steps done), loss, <metric>, lr, examples, bytes (all nodes,
    cumulative), wall_time_s. val rows: step, local_loss (node 0's model), global_loss (the global
    model), and local_/global_ versions of every extra metric.
    """

    config: dict[str, Any]
    train: list[dict[str, float]]
    val: list[dict[str, float]]
    node_loss: list[list[float]]
    bytes_per_node: list[int]
    comm_per_node: list[dict[str, Any]]
    wall_time_s: float

    @classmethod
    def from_nodes(cls, logs: list[NodeLog], *, config: dict[str, Any], global_batch: int,
                   wall_time_s: float) -> "RunRecord":
        k = len(logs)
        steps = len(logs[0].loss)
        train = []
        for s in range(steps):
            row: dict[str, float] = {"step": s + 1, "loss": sum(log.loss[s] for log in logs) / k}
            for name in logs[0].metrics:
                row[name] = sum(log.metrics[name][s] for log in logs) / k
            row.update(lr=logs[0].lr[s], examples=(s + 1) * global_batch,
                       bytes=sum(log.bytes_sent[s] for log in logs), wall_time_s=logs[0].wall_time_s[s])
            train.append(row)
        return cls(config=config, train=train, val=logs[0].val, node_loss=[log.loss for log in logs],
                   bytes_per_node=[log.bytes_sent[-1] if log.bytes_sent else 0 for log in logs],
                   comm_per_node=[log.comm for log in logs], wall_time_s=wall_time_s)

    def column(self, name: str, table: str = "train") -> list[float]:
        rows = self.train if table == "train" else self.val
        if rows and name not in rows[0]:
            raise KeyError(f"no column {name!r} in the {table} rows; columns are {list(rows[0])}")
        return [row[name] for row in rows]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_node)
