"""Loggers: where a run's configuration and measurements go while it trains.

`fit(logger=...)` takes one of these (or a list of them). By default a CSVLogger writes into
`logs/<run_name>/`: config.json (the run's full configuration), train.csv and val.csv (one row
per step / per evaluation, written every `log_interval` steps), summary.json at the end.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["Logger", "CSVLogger", "WandbLogger", "TensorBoardLogger", "MultiLogger", "default_run_name"]


def default_run_name(config: dict[str, Any]) -> str:
    return f"{config.get('strategy', 'run')}-{config.get('num_nodes', 1)}n-{time.strftime('%Y%m%d-%H%M%S')}"


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "to_dict"):
        return _json_safe(value.to_dict())
    if isinstance(value, type) or inspect.isfunction(value):  # by name: a repr would hold a memory address
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)


class Logger:
    """Receives the run's configuration, rows as they are measured, and the final record."""

    def start(self, config: dict[str, Any]) -> None:
        """Called once before the first step, with the run's full configuration."""

    def log(self, table: str, row: dict[str, float]) -> None:
        """A row of the "train" table (one per step) or the "val" table (one per evaluation)."""

    def finish(self, summary: dict[str, Any]) -> None:
        """Called once after the last step (also when the run failed: summary["status"] says)."""


class CSVLogger(Logger):
    """Writes logs/<run_name>/{config.json, train.csv, val.csv, summary.json}."""

    def __init__(self, log_dir: str | os.PathLike = "logs", run_name: str | None = None):
        self.log_dir, self.run_name = Path(log_dir), run_name
        self.run_dir: Path | None = None
        self._files: dict[str, Any] = {}
        self._writers: dict[str, csv.DictWriter] = {}

    def start(self, config: dict[str, Any]) -> None:
        self.run_name = self.run_name or default_run_name(config)
        self.run_dir = self.log_dir / self.run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(_json_safe(config), indent=2) + "\n")

    def log(self, table: str, row: dict[str, float]) -> None:
        if table not in self._writers:
            f = open(self.run_dir / f"{table}.csv", "w", newline="")
            self._files[table] = f
            self._writers[table] = csv.DictWriter(f, fieldnames=list(row), extrasaction="ignore")
            self._writers[table].writeheader()
        self._writers[table].writerow(row)
        self._files[table].flush()

    def finish(self, summary: dict[str, Any]) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._writers.clear()
        if self.run_dir is not None:
            (self.run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2) + "\n")


class WandbLogger(Logger):
    """Weights & Biases (`pip install exogym[wandb]`); mode="offline" writes locally without an account."""

    def __init__(self, project: str = "exogym", run_name: str | None = None, *, mode: str | None = None,
                 dir: str | os.PathLike | None = None, **init_kwargs: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbLogger needs wandb: pip install 'exogym[wandb]'") from e
        self._wandb, self.project, self.run_name = wandb, project, run_name
        self.mode, self.dir, self.init_kwargs = mode, dir, init_kwargs
        self.run = None

    def start(self, config: dict[str, Any]) -> None:
        self.run = self._wandb.init(project=self.project, name=self.run_name or default_run_name(config),
                                    config=_json_safe(config), mode=self.mode,
                                    dir=str(self.dir) if self.dir else None, **self.init_kwargs)

    def log(self, table: str, row: dict[str, float]) -> None:
        self.run.log({f"{table}/{k}": v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(_json_safe({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}))
            self.run.finish()


class TensorBoardLogger(Logger):
    """TensorBoard event files under log_dir/run_name (`pip install exogym[tensorboard]`)."""

    def __init__(self, log_dir: str | os.PathLike = "logs", run_name: str | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardLogger needs tensorboard: pip install 'exogym[tensorboard]'") from e
        self._writer_cls, self.log_dir, self.run_name = SummaryWriter, Path(log_dir), run_name
        self.writer = None

    def start(self, config: dict[str, Any]) -> None:
        self.run_name = self.run_name or default_run_name(config)
        self.writer = self._writer_cls(log_dir=str(self.log_dir / self.run_name))
        self.writer.add_text("config", "```\n" + json.dumps(_json_safe(config), indent=2) + "\n```")

    def log(self, table: str, row: dict[str, float]) -> None:
        for k, v in row.items():
            if k != "step":
                self.writer.add_scalar(f"{table}/{k}", v, int(row["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.close()


class MultiLogger(Logger):
    """Fans every call out to several loggers (`fit(logger=[CSVLogger(), WandbLogger()])`)."""

    def __init__(self, loggers: Sequence[Logger]):
        self.loggers = list(loggers)

    def start(self, config: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.start(config)

    def log(self, table: str, row: dict[str, float]) -> None:
        for lg in self.loggers:
            lg.log(table, row)

    def finish(self, summary: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.finish(summary)
