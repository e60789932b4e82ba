"""Loggers: where a run's configuration and measurements go while it trains.

`fit(logger=...)` takes one of these (or a list of them). By default a CSVLogger writes into
`logs/<run_name>/`: config.json (the run's full configuration), train.csv and val.csv (one row
per step / per evaluation, written every `log_interval` steps), summary.json at the end.

A run folder belongs to one run (exogym.runs.folder): `fit` claims `<log_dir>/<run_name>/` for the
CSV and TensorBoard loggers atomically before any node starts; a taken default name gets a -2, -3
suffix, a taken explicit name's ended run is moved aside (exogym.runs.rerun) unless fit(overwrite=True) replaces
it, or the run resumes itself.
A run that fails before any training row was written leaves no CSV run folder behind.

On a full disk nothing is left half-written (exogym.runs.disk): config.json and summary.json appear whole or not
at all, a CSV table ends on a whole row, and a CSVLogger whose start fails leaves no file that would block the
name. `finish` never raises over the run's own error: a summary that cannot be written is one line on stderr.

Table views (`TableView`): a CSVLogger also writes what its views make of each row: more columns of the same
table, or rows of other CSV files in the run folder (exogym.compat writes the original EXO Gym's
validation.csv and train.csv columns this way). `register_table_view` adds a view to every CSVLogger.
"""

from __future__ import annotations

import csv
import inspect
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from exogym.runs.disk import AppendFile, warn, write_text
from exogym.runs.folder import RunClaim, check_run_name, claim_run
from exogym.runs.timeline import write_timeline
from exogym.adapters import Adaptable

__all__ = ["Logger", "CSVLogger", "WandbLogger", "TensorBoardLogger", "MultiLogger", "default_run_name",
           "truncate_rows_after", "TableView", "register_table_view", "perplexity", "wandb_metrics"]

# view(table, row) -> {table name: columns}: under the row's own table, columns appended to that row; under another
# name, a row of <that name>.csv in the run folder (None: an empty cell). Called on every row a CSVLogger writes.
TableView = Callable[[str, Mapping[str, float]], Mapping[str, Mapping[str, "float | None"]]]

_VIEWS: list[TableView] = []


def register_table_view(view: TableView) -> None:
    """Every CSVLogger (made before or after) writes what `view` makes of each of its rows, after its own views.

    Args:
        view: A function `view(table, row) -> {csv_name: row}` (a None cell is written empty).
    """
    if view not in _VIEWS:
        _VIEWS.append(view)


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (a loss above ~709).

    Args:
        loss: A mean cross-entropy.

    Returns:
        The perplexity.
    """
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def wandb_metrics(table: str, row: Mapping[str, float]) -> dict[str, float]:
    """A row's W&B metrics under the original EXO Gym's names.

    `train_loss`, `train_perplexity` and `lr` from a `"train"` row (its other columns as `train_<column>`);
    `local_loss`, `local_perplexity`, `global_loss`, `global_perplexity` (and the other columns as they are) from a
    `"val"` row; `<table>_<column>` from another table. `step` and `examples` are left to the caller (the x-axes).

    Args:
        table: The row's table: `"train"`, `"val"` or another.
        row: The row.

    Returns:
        The metrics.
    """
    out: dict[str, float] = {}
    for k, v in row.items():
        if k in ("step", "examples"):
            continue
        if table == "train":
            out["lr" if k == "lr" else f"train_{k}"] = v
        elif table == "val":
            out[k] = v
        else:
            out[f"{table}_{k}"] = v
    for loss in [k for k in out if k in ("train_loss", "local_loss", "global_loss")]:
        out[loss[:-len("loss")] + "perplexity"] = perplexity(out[loss])
    return out


def default_run_name(config: dict[str, Any]) -> str:
    """The default run name: strategy-nodes-time; `exogym.runs.folder` adds -2, -3, ... when that folder is taken.

    Args:
        config: The run's configuration (its `strategy` and `num_nodes`).

    Returns:
        The name, e.g. `DiLoCoStrategy-4n-20260101-120000`.
    """
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


class Logger(metaclass=Adaptable):
    """Receives the run's configuration, rows as they are measured, and the final record.

    A logger of your own subclasses this and overrides the three methods; `fit(logger=...)` takes it.
    """

    def start(self, config: dict[str, Any]) -> None:
        """Called once before the first step, with the run's full configuration.

        Args:
            config: What `config.json` holds (strategy, model size, nodes, seed, versions, ...).
        """

    def log(self, table: str, row: dict[str, float]) -> None:
        """A row of the `"train"` table (one per step) or the `"val"` table (one per evaluation).

        Args:
            table: `"train"` or `"val"`.
            row: The row: `step` and the measured columns (see RunRecord).
        """

    def finish(self, summary: dict[str, Any]) -> None:
        """Called once after the last step (also when the run failed: `summary["status"]` says).

        Args:
            summary: What `summary.json` holds: the headline numbers and how the run ended.
        """

    def written_through(self, table: str) -> int | None:
        """For a run resumed into the folder it already has: the last step of `table` this logger holds.

        Args:
            table: "train" or "val".

        Returns:
            That step (0: none), or None where the logger cannot say (then fit writes nothing again). fit logs the
            rows between it and the checkpoint's step from what the checkpoint carries, so none is missing.
        """
        return None


class _FolderLogger(Logger):
    """A logger writing into `<log_dir>/<run_name>/`, a folder it holds for one run (see `exogym.runs.folder`)."""

    def __init__(self, log_dir: str | os.PathLike, run_name: str | None):
        if run_name is not None:
            check_run_name(run_name)
        self.log_dir, self.run_name = Path(log_dir), run_name
        self.requested_name = run_name  # what the user asked for; run_name becomes the claimed name of each run
        self.run_dir: Path | None = None
        self.claim: RunClaim | None = None  # set by fit, which claims the folders of all its loggers at once
        self._own_claim = False
        self._running = False  # between start() and finish()
        self.after_step: int | None = None

    def continue_after(self, step: int) -> None:
        """Continue a run resumed from its checkpoint at `step`, in the run folder it already has.

        Call before `start()`. `start()` then reopens `<log_dir>/<run_name>/` (which must hold that run, not a
        running one) instead of claiming a new folder, and the rows the run logged after `step` (logged before it
        stopped, and about to be trained again) are dropped: the folder then holds the whole run once.
        `fit(resume_from=...)` calls this when it resumes a run into its own folder.

        Args:
            step: The checkpoint's step.

        Raises:
            ValueError: `step` is not an int >= 0.
            RuntimeError: Called after `start()`.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"continue_after needs the checkpoint's step, an int >= 0, got {step!r}")
        if self._running:
            raise RuntimeError("continue_after must be called before start()")
        self.after_step = step

    def _open_run_dir(self, config: dict[str, Any]) -> Path:
        if self.claim is None:  # used on its own, outside fit: claim the folder now
            self.claim = claim_run([self.log_dir], self.requested_name, default_run_name(config),
                                   resume=self.after_step is not None)
            self._own_claim = True
        self.run_name = self.claim.name
        self.run_dir = self.log_dir / self.run_name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._running = True
        return self.run_dir

    def _release(self, summary: dict[str, Any]) -> None:
        if self._own_claim and self.claim is not None:
            error = summary.get("error")
            self.claim.release(str(summary.get("status", "completed")), error if isinstance(error, str) else None)
        # Ready for another run (a logger passed to several fits): each claims its own folder.
        self.claim, self._own_claim, self.after_step, self._running = None, False, None, False


class CSVLogger(_FolderLogger):
    """Writes `logs/<run_name>/`: `config.json`, `train.csv`, `val.csv`, `summary.json`.

    Also what its table views (`views=`, then the registered ones) make of each row. To resume a run in its
    folder, see `continue_after`. A run that fails before its first training row leaves no folder (the claim
    is given back), unless it failed because a process of the run went away (`summary["lost_peer"]`); once one
    is written, `summary.json` says how it ended.

    Args:
        log_dir: The folder of run folders.
        run_name: The run folder's name; None: fit's `run_name`, or a default name (strategy, nodes, time).
        views: Table views: functions `view(table, row) -> {csv_name: row}`, each returned row written to
            `<csv_name>.csv` in the run folder.
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", run_name: str | None = None, *,
                 views: Sequence[TableView] = ()):
        super().__init__(log_dir, run_name)
        self.views = list(views)
        self._files: dict[str, AppendFile] = {}
        self._columns: dict[str, list[str]] = {}
        self._trained = False  # a training row was written
        self._through: dict[str, int] = {}  # resumed: the last step each table held

    def start(self, config: dict[str, Any]) -> None:
        run_dir = self._open_run_dir(config)
        self._trained = False
        try:
            self._through = {}
            if self.after_step is not None:
                for table in run_dir.glob("*.csv"):
                    truncate_rows_after(table, self.after_step)
                for table in ("train", "val"):
                    self._through[table] = _last_step(run_dir / f"{table}.csv")
                (run_dir / "summary.json").unlink(missing_ok=True)  # written again when the run ends
            write_text(run_dir / "config.json", json.dumps(_json_safe(config), indent=2) + "\n", "the run's config")
        except BaseException:  # config.json is written whole or not at all: nothing of it is left to block the name
            if self._own_claim and self.claim is not None:
                self.claim.abandon()  # (fit gives back the claim it made itself)
            self.claim, self._own_claim, self._running = None, False, False
            raise

    def written_through(self, table: str) -> int | None:
        return self._through.get(table)

    def log(self, table: str, row: dict[str, float]) -> None:
        rows = {table: dict(row)}
        for view in [*self.views, *(v for v in _VIEWS if v not in self.views)]:
            for name, columns in view(table, row).items():
                rows.setdefault(name, {}).update(columns)
        for name, out in rows.items():
            self._write(name, out)
        self._trained = self._trained or table == "train"

    def _write(self, table: str, row: dict[str, float]) -> None:
        """One row, appended as one write: the file ends on a whole row even when the disk fills up."""
        if table not in self._files:
            path = self.run_dir / f"{table}.csv"
            header = _csv_header(path) if self.after_step is not None else None
            # A resumed run appends under the header it has.
            self._files[table] = AppendFile(path, f"the {table} table", fresh=not header)
            self._columns[table] = header or list(row)
            if not header:
                self._files[table].append(_csv_line(self._columns[table]))
        columns = self._columns[table]
        self._files[table].append(_csv_line([row.get(c, "") for c in columns]))

    def finish(self, summary: dict[str, Any]) -> None:
        for f in self._files.values():
            f.close()
        written = [f.path for f in self._files.values()]
        self._files.clear()
        self._columns.clear()
        if summary.get("status") == "failed" and not self._trained and self.after_step is None \
                and "lost_peer" not in summary and self.run_dir is not None and self.claim is not None:
            # Failed before a training row was written: no training to keep, so the folder is given back.
            for path in [self.run_dir / "config.json", *written]:
                path.unlink(missing_ok=True)
            self.claim.abandon()
        elif self.run_dir is not None:
            try:
                if summary.get("timeline") is not None:  # its own file: exogym ui and exogym trace read it
                    write_timeline(self.run_dir, summary["timeline"])
                summary = {k: v for k, v in summary.items() if k != "timeline"}
                write_text(self.run_dir / "summary.json", json.dumps(_json_safe(summary), indent=2) + "\n",
                           "the run's summary")
            except OSError as e:  # never over the run's own error; the run folder's marker still says how it ended
                warn(f"the run's summary was not written: {e}")
        self._release(summary)


def _csv_line(cells: Sequence[Any]) -> str:
    """One CSV row, as csv.writer writes it (quoted where needed, \\r\\n at the end)."""
    out = io.StringIO()
    csv.writer(out).writerow(cells)
    return out.getvalue()


def _last_step(path: Path) -> int:
    """The step of a CSV table's last row (0: no table, or no row)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except FileNotFoundError:
        return 0
    if len(rows) < 2 or "step" not in rows[0]:
        return 0
    try:
        return int(float(rows[-1][rows[0].index("step")]))
    except (ValueError, IndexError):
        return 0


def _csv_header(path: Path) -> list[str] | None:
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), None) or None
    except FileNotFoundError:
        return None


def truncate_rows_after(path: str | os.PathLike, step: int) -> int:
    """Keep the header and the rows of a CSV table whose `"step"` is <= `step`.

    Atomically: a crash leaves the old file or the new one. A row cut off by a crash mid-write is dropped too.

    Args:
        path: The CSV file.
        step: The last step kept.

    Returns:
        How many rows were kept.
    """
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return 0
    header, kept = rows[0], []
    at = header.index("step") if "step" in header else None
    for row in rows[1:]:
        if len(row) != len(header) or at is None:
            continue
        try:
            if float(row[at]) <= step:
                kept.append(row)
        except ValueError:
            continue
    write_text(path, "".join(_csv_line(r) for r in [header, *kept]), f"the table {path.name}")
    return len(kept)


class WandbLogger(Logger):
    """Weights & Biases (`pip install exogym[wandb]`); `mode="offline"` writes locally without an account.

    The metrics carry the original EXO Gym's names (`wandb_metrics`). `experiment_name=` is the original
    documents' `run_name=`.

    Args:
        project: The W&B project.
        run_name: The W&B run's name; None: fit's run name.
        mode: None (the default) logs online when W&B has an API key and its server answers, and otherwise
            offline (saying so once per process, with the `wandb sync` command that uploads the runs later); or
            `"online"`, `"offline"`, `"disabled"`.
        dir: Where W&B writes its files.
        x_axis: `"step"` or `"examples"` (the global examples trained): the x-axis of every chart.
        **init_kwargs: Passed on to `wandb.init`.

    Raises:
        ImportError: wandb is not installed.
        ValueError: An unknown `mode` or `x_axis`.
    """

    def __init__(self, project: str = "exogym", run_name: str | None = None, *, mode: str | None = None,
                 dir: str | os.PathLike | None = None, x_axis: str = "step", **init_kwargs: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("WandbLogger needs wandb: pip install 'exogym[wandb]'") from e
        if x_axis not in ("step", "examples"):
            raise ValueError(f"x_axis must be 'step' or 'examples', got {x_axis!r}")
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"mode must be None (online when possible), 'online', 'offline' or 'disabled', "
                             f"got {mode!r}")
        self._wandb, self.project, self.run_name = wandb, project, run_name
        self.mode, self.dir, self.x_axis, self.init_kwargs = mode, dir, x_axis, init_kwargs
        self.run = None
        self._global_batch = 0

    def start(self, config: dict[str, Any]) -> None:
        self._global_batch = int(config.get("global_batch", 0))
        mode, why_offline = (self.mode, None) if self.mode is not None else _wandb_mode(self._wandb)
        self.run = self._wandb.init(project=self.project, name=self.run_name or default_run_name(config),
                                    config=_json_safe(config), mode=mode,
                                    dir=str(self.dir) if self.dir else None, **self.init_kwargs)
        if why_offline is not None:
            _say_offline(why_offline, Path(self.run.dir).parent)
        # Charts against a logged column rather than wandb's own step, which must only grow: validation rows can
        # arrive before the training rows of the same steps.
        self.run.define_metric(self.x_axis)
        self.run.define_metric("*", step_metric=self.x_axis)

    def log(self, table: str, row: dict[str, float]) -> None:
        data = wandb_metrics(table, row)
        data["step"] = int(row["step"])
        data["examples"] = row.get("examples", int(row["step"]) * self._global_batch)
        self.run.log(data)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(_json_safe({k: v for k, v in summary.items() if not isinstance(v, (list, dict))}))
            self.run.finish()


_SAID_OFFLINE = False  # the offline hint is printed once per process


def _wandb_mode(wandb: Any) -> tuple[str, str | None]:
    """("online", None) when W&B has an API key and its server answers within 3 s; else ("offline", why)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], None  # the user's own W&B setting (wandb reads it too)
    reason = None
    try:
        has_key = bool(os.environ.get("WANDB_API_KEY") or wandb.Api().api_key)
    except Exception:  # noqa: BLE001 - wandb raises several kinds when no key is configured
        has_key = False
    if not has_key:
        reason = "no W&B API key is configured (wandb login)"
    else:
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError:
            reason = f"{host} cannot be reached"
    return ("online", None) if reason is None else ("offline", reason)


def _say_offline(reason: str, run_dir: Path) -> None:
    """Once per process: W&B logs offline, why, and the command that uploads every offline run there later."""
    global _SAID_OFFLINE
    if _SAID_OFFLINE:
        return
    _SAID_OFFLINE = True
    runs = run_dir.parent / "offline-run-*"  # wandb's folder of this run is <wandb dir>/offline-run-<time>-<id>
    print(f"exogym: W&B logs offline: {reason}; upload the runs later with `wandb sync {runs}`", flush=True)


class TensorBoardLogger(_FolderLogger):
    """TensorBoard event files under `log_dir/run_name` (`pip install exogym[tensorboard]`).

    A resumed run (`continue_after`) purges the events after the checkpoint's step, as CSVLogger drops those
    rows.

    Args:
        log_dir: The folder of run folders.
        run_name: The run folder's name; None: fit's run name.

    Raises:
        ImportError: tensorboard is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike = "logs", run_name: str | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardLogger needs tensorboard: pip install 'exogym[tensorboard]'") from e
        super().__init__(log_dir, run_name)
        self._writer_cls = SummaryWriter
        self.writer = None

    def start(self, config: dict[str, Any]) -> None:
        run_dir = self._open_run_dir(config)
        purge = None if self.after_step is None else self.after_step + 1
        self.writer = self._writer_cls(log_dir=str(run_dir), purge_step=purge)
        self.writer.add_text("config", "```\n" + json.dumps(_json_safe(config), indent=2) + "\n```")

    def log(self, table: str, row: dict[str, float]) -> None:
        for k, v in row.items():
            if k != "step":
                self.writer.add_scalar(f"{table}/{k}", v, int(row["step"]))

    def finish(self, summary: dict[str, Any]) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except (OSError, RuntimeError) as e:  # never over the run's own error
                warn(f"the TensorBoard events in {str(self.run_dir)!r} may be incomplete: {e}")
        self._release(summary)


class MultiLogger(Logger):
    """Fans every call out to several loggers (`fit(logger=[CSVLogger(), WandbLogger()])`).

    Args:
        loggers: The loggers, in order.
    """

    def __init__(self, loggers: Sequence[Logger]):
        self.loggers = list(loggers)

    def start(self, config: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.start(config)

    def log(self, table: str, row: dict[str, float]) -> None:
        for lg in self.loggers:
            lg.log(table, row)

    def finish(self, summary: dict[str, Any]) -> None:
        """Finish every logger, even after one fails.

        That failure is raised after them for a completed run, and only said on stderr for a run that did not
        complete (its own error is the one that matters).

        Args:
            summary: What `summary.json` holds.
        """
        failed = None
        for lg in self.loggers:
            try:
                lg.finish(summary)
            except Exception as e:  # noqa: BLE001 - reported below, after the other loggers
                failed = failed or e
                if summary.get("status") != "completed":
                    warn(f"{type(lg).__name__} could not finish: {type(e).__name__}: {e}")
        if failed is not None and summary.get("status") == "completed":
            raise failed
