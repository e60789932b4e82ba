"""What a sweep optimises: a summary metric of each run, optionally read at a budget or under a constraint.

The metrics of a run are the numbers of `trainer.record.summary()` (a per-node list becomes its mean over the
nodes: `payload_bytes_per_node` is the mean payload a node sent) and any the run function returns beside the
record. Three short names stand for the summary's headline losses: `val_loss` is `final_global_loss` (the global
model's validation loss at the end), `val_accuracy` is `final_global_accuracy`, `train_loss` is `final_train_loss`.

- budget_bytes=N / budget_sim_time=T: the objective is read from the run's rows at the last evaluation made
  when the run had sent at most N bytes per node (wire bytes, the record's `bytes` column) or spent at most T
  simulated seconds: "the loss reachable for N bytes". A run that never reaches the budget gives its final value.
- max_bytes=N / max_sim_time=T: a constraint. A configuration whose runs sent more than N wire bytes per node
  (or took more than T simulated seconds) is infeasible: kept in the table, never the best, and the TPE
  sampler is told (Optuna's constraints).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = ["Objective", "MissingMetricError", "SHORT_NAMES", "parse_bytes", "metric_name"]

SHORT_NAMES = {"val_loss": "final_global_loss", "val_accuracy": "final_global_accuracy",
               "train_loss": "final_train_loss"}
# Scalars every summary has (sim_time_s only with a time model); the per-node lists are taken as means.
_SUMMARY = ("steps", "final_train_loss", "final_local_loss", "final_global_loss", "total_bytes", "bytes_per_node",
            "wire_bytes_per_node", "payload_bytes_per_node", "wall_time_s", "sim_time_s")
_MODEL_METRIC = re.compile(r"final_(local|global)_\w+")
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2 ** 10, "MIB": 2 ** 20,
          "GIB": 2 ** 30}


class MissingMetricError(KeyError):
    """A run lacks what the objective reads (a metric, simulated time, a row within the budget): every run of the
    sweep would, so the sweep stops and says what to change."""


def parse_bytes(value: float | int | str, what: str) -> float:
    """5e6, "5MB", "300 KB", "1.5GB" (decimal units; KiB, MiB, GiB binary) -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", str(value))
        unit = m.group(2).upper() if m else ""
        try:
            number = float(m.group(1)) * _UNITS[unit] if m else math.nan
        except (KeyError, ValueError):
            number = math.nan
    if not number > 0 or not math.isfinite(number):
        raise ValueError(f"{what} must be a positive number of bytes (5e6, '5MB', '300KB', '1.5GB'), got {value!r}")
    return number


def metric_name(name: str) -> str:
    """The summary's name for a metric (the short names resolved)."""
    return SHORT_NAMES.get(name, name)


@dataclass(frozen=True)
class Objective:
    """metric (a summary metric or a short name), direction ("minimize"/"maximize"; None: maximize a metric
    whose name ends in "accuracy", else minimize), the budget and the constraints (see the module's docstring)."""

    metric: str = "val_loss"
    direction: str | None = None
    budget_bytes: float | None = None
    budget_sim_time: float | None = None
    max_bytes: float | None = None
    max_sim_time: float | None = None
    extra_metrics: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        name = metric_name(self.metric)
        known = set(_SUMMARY) | set(self.extra_metrics)
        if name not in known and not _MODEL_METRIC.fullmatch(name):
            raise ValueError(f"unknown objective {self.metric!r}; use a summary metric ({', '.join(sorted(known))}, "
                             f"final_global_<metric> or final_local_<metric> for a metric the model returns), or one "
                             f"of the short names {', '.join(sorted(SHORT_NAMES))}; a metric the run function "
                             "returns beside the record is named in extra_metrics=")
        direction = self.direction or ("maximize" if name.endswith("accuracy") else "minimize")
        if direction not in ("minimize", "maximize"):
            raise ValueError(f"direction must be 'minimize' or 'maximize', got {self.direction!r}")
        object.__setattr__(self, "direction", direction)
        if self.budget_bytes is not None and self.budget_sim_time is not None:
            raise ValueError("give one budget, budget_bytes or budget_sim_time, not both")
        for what in ("budget_bytes", "max_bytes"):
            if getattr(self, what) is not None:
                object.__setattr__(self, what, parse_bytes(getattr(self, what), what))
        for what in ("budget_sim_time", "max_sim_time"):
            value = getattr(self, what)
            if value is not None and (not isinstance(value, (int, float)) or not value > 0 or value == math.inf):
                raise ValueError(f"{what} must be a positive number of simulated seconds, got {value!r}")
        if self.budgeted and _row_column(name) is None:
            raise ValueError(f"a budget reads the objective from the run's rows, so it must be a validation or "
                             f"training metric (val_loss, final_global_<metric>, train_loss), got {self.metric!r}")

    @property
    def name(self) -> str:
        return metric_name(self.metric)

    @property
    def budgeted(self) -> bool:
        return self.budget_bytes is not None or self.budget_sim_time is not None

    @property
    def needs_sim_time(self) -> bool:
        return self.budget_sim_time is not None or self.max_sim_time is not None or self.name == "sim_time_s"

    def describe(self) -> str:
        text = f"{self.metric}" + (f" ({self.name})" if self.name != self.metric else "") + f", {self.direction}d"
        if self.budget_bytes is not None:
            text += f", read at {self.budget_bytes:.4g} bytes sent per node"
        if self.budget_sim_time is not None:
            text += f", read at {self.budget_sim_time:g} simulated seconds"
        limits = [f"wire bytes per node <= {self.max_bytes:.4g}"] if self.max_bytes is not None else []
        limits += [f"simulated time <= {self.max_sim_time:g} s"] if self.max_sim_time is not None else []
        return text + (f"; feasible when {' and '.join(limits)}" if limits else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"extra_metrics": list(self.extra_metrics)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Objective":
        return cls(**{**data, "extra_metrics": tuple(data.get("extra_metrics", ()))})

    def measure(self, record: Any, extra: Mapping[str, float] | None = None) -> dict[str, float]:
        """The run's metrics: the summary's numbers, `extra`, "objective" (at the budget, if any) and
        "violation" (how far over the constraints, 0 when feasible)."""
        metrics: dict[str, float] = {}
        for key, value in record.summary().items():
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)):
                metrics[key] = float(value)
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
                metrics[key] = sum(value) / len(value)
        for key, value in (extra or {}).items():
            metrics[key] = float(value)
        if self.name not in metrics:
            have = ", ".join(sorted(metrics))
            why = " (the runs have no simulated time: give fit a network=, or --network)" \
                if self.name == "sim_time_s" else ""
            raise MissingMetricError(f"the objective {self.metric!r} is not among this run's metrics{why}; it has {have}")
        metrics["objective"] = self._at_budget(record) if self.budgeted else metrics[self.name]
        metrics["violation"] = self._violation(metrics)
        return metrics

    def _at_budget(self, record: Any) -> float:
        column = "bytes" if self.budget_bytes is not None else "sim_time_s"
        budget = self.budget_bytes if self.budget_bytes is not None else self.budget_sim_time
        if record.train and column not in record.train[0]:
            raise MissingMetricError("budget_sim_time reads each step's simulated time, and this run has none: give fit a "
                           "network= (or --network)")
        spent = {0: 0.0, **{int(row["step"]): row[column] for row in record.train}}  # step 0: nothing spent yet
        table, col = _row_column(self.name)
        rows = record.val if table == "val" else record.train
        within = [row for row in rows if spent.get(int(row["step"]), math.inf) <= budget and col in row]
        if not within:
            raise MissingMetricError(f"no {table} row of this run was made within the budget, so {self.metric!r} at the "
                           "budget is unknown; raise the budget or validate from step 0")
        return float(within[-1][col])

    def _violation(self, metrics: Mapping[str, float]) -> float:
        over = 0.0
        if self.max_bytes is not None:
            over += max(0.0, metrics.get("wire_bytes_per_node", 0.0) - self.max_bytes) / self.max_bytes
        if self.max_sim_time is not None:
            if "sim_time_s" not in metrics:
                raise MissingMetricError("max_sim_time needs the runs' simulated time: give fit a network= (or --network)")
            over += max(0.0, metrics["sim_time_s"] - self.max_sim_time) / self.max_sim_time
        return over


def _row_column(name: str) -> tuple[str, str] | None:
    """Where a final_* metric lives in the record's rows: ("val", "global_loss") for final_global_loss."""
    if name == "final_train_loss":
        return "train", "loss"
    m = _MODEL_METRIC.fullmatch(name)
    return ("val", name[len("final_"):]) if m else None
