"""One run of a sweep: a configuration with one seed, as a normal run folder under the sweep folder.

The user's run function builds a Trainer and calls `fit` without naming a folder. While it runs, the first
`fit` call of the run is given (through `exogym.adapters`, the core's argument hook, and only for the
arguments the call leaves out): a CSVLogger writing `<sweep>/runs/<run name>/`, checkpoints in that folder's
`checkpoints/` every `checkpoint_interval` steps, `resume_from=` its last checkpoint when an earlier attempt
left one (the run continues bit-identically), `overwrite=True` when an earlier attempt left a folder without one
(it starts again), and `progress=False` (the sweep shows its own bar).

How a run ends: "completed"; "diverged" (a nan/inf loss: FloatingPointError, or a nan objective), "failed"
(any other exception, with its message). Ctrl-C and SIGTERM propagate as KeyboardInterrupt: the run is
interrupted, and continues from its checkpoint when the sweep resumes.
"""

from __future__ import annotations

import contextvars
import fcntl
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from exogym.adapters import register_adapter
from exogym.runs.checkpoint import CheckpointError, find_checkpoint
from exogym.runs.loggers import CSVLogger
from exogym.sweep.objective import MissingMetricError, Objective
from exogym.sweep.space import Value, run_name
from exogym.trainer import Trainer

__all__ = ["MISSING_METRIC", "RunOutcome", "run_seed", "run_folder", "RunLock", "config_status", "write_outcome",
           "read_outcome", "RUNS", "LOCKS"]

RUNS, LOCKS = "runs", ".locks"  # under the sweep folder: the run folders, and one lock file per run
MISSING_METRIC = "MissingMetric"  # how an outcome's error starts when the run lacks what the objective reads


@dataclass
class RunOutcome:
    """How one (configuration, seed) run ended: status, metrics (objective.measure), error, where, how long."""

    seed: int
    status: str  # "completed", "diverged" or "failed"
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    run_dir: str | None = None  # relative to the sweep folder
    wall_s: float = 0.0
    resumed_from: str | None = None
    unread: list[str] = field(default_factory=list)  # parameters the run function never looked at

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "RunOutcome":
        return cls(**data)


@dataclass
class _FitDefaults:
    """What the first fit call of a sweep run is given (see the module's docstring)."""

    log_dir: Path
    name: str
    checkpoint_interval: int | None
    resume_from: Path | None
    overwrite: bool
    used: bool = False


_ACTIVE: contextvars.ContextVar[_FitDefaults | None] = contextvars.ContextVar("exogym_sweep_run", default=None)


def run_folder() -> Path | None:
    """The run folder of the sweep run this process is running (to save more into it: a model, samples), or None
    outside a sweep run."""
    d = _ACTIVE.get()
    return None if d is None else d.log_dir / d.name


def _fill_fit_defaults(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    d = _ACTIVE.get()
    if d is None or d.used:
        return args, kwargs
    d.used = True  # a run function calling fit twice: only the first call is the sweep's run
    kwargs = dict(kwargs)
    if kwargs.get("logger") in (None, True) and kwargs.get("run_name") is None:
        kwargs["logger"] = CSVLogger(d.log_dir, d.name)
    kwargs.setdefault("progress", False)
    folder = d.log_dir / d.name
    if d.checkpoint_interval is not None and kwargs.get("checkpoint_interval") is None:
        kwargs["checkpoint_interval"] = d.checkpoint_interval
    if kwargs.get("checkpoint_interval") is not None or d.resume_from is not None:
        kwargs.setdefault("checkpoint_dir", folder / "checkpoints")
    if d.resume_from is not None:
        kwargs.setdefault("resume_from", d.resume_from)
    elif d.overwrite:
        kwargs.setdefault("overwrite", True)
    return args, kwargs


register_adapter(Trainer.fit, _fill_fit_defaults)


class RunLock:
    """The lock of one run: an flock on <sweep>/.locks/<run name>, which the kernel drops when its holder dies
    (SIGKILL included), so a lock is never left stale. Two workers never run the same run at once."""

    def __init__(self, sweep_dir: Path, name: str):
        self.path = sweep_dir / LOCKS / name
        self._fd: int | None = None

    def acquire(self, *, wait: bool) -> bool:
        """Take the lock; with wait=False return False at once if another holder has it."""
        self.path.parent.mkdir(exist_ok=True)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def held_elsewhere(self) -> bool:
        """Whether some holder (another process, or another lock object) has it now."""
        if not self.path.exists():
            return False
        probe = RunLock(self.path.parent.parent, self.path.name)
        if probe.acquire(wait=False):
            probe.release()
            return False
        return True


def _earlier_attempt(folder: Path) -> tuple[Path | None, bool]:
    """(the newest complete checkpoint an earlier attempt left, whether it left a folder at all)."""
    if not folder.exists():
        return None, False
    try:
        return find_checkpoint(folder / "checkpoints"), True
    except CheckpointError:
        return None, any(folder.iterdir())


class _Config(dict):
    """The configuration handed to the run function, noting which parameters it reads: a parameter it never
    reads (a typo, or one it does not take) would give every value the same runs."""

    def __init__(self, values: Mapping[str, Value]):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)
        return super().__contains__(key)

    def _all(self) -> None:
        self.read.update(super().keys())

    def keys(self) -> Any:  # {**config}, dict(config), Namespace(**config): all of it is passed on
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def __iter__(self) -> Any:
        self._all()
        return super().__iter__()


def _unpack(result: Any) -> tuple[Any, dict[str, float]]:
    """The run function returns trainer.record, or (trainer.record, {metric: value}) for metrics the record
    does not hold (e.g. a loss on a held-out set)."""
    record, extra = (result if isinstance(result, tuple) and len(result) == 2 else (result, {}))
    if not hasattr(record, "summary") or not isinstance(extra, Mapping):
        raise TypeError(f"the run function must return trainer.record, or (trainer.record, {{name: number}}), "
                        f"got {type(result).__name__}")
    bad = {k: v for k, v in extra.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise TypeError(f"the metrics returned beside the record must be numbers, got {bad!r}")
    return record, dict(extra)


def run_seed(run: Callable[[dict[str, Value]], Any], config: Mapping[str, Value], seed: int, *, sweep_dir: Path,
             objective: Objective, checkpoint_interval: int | None) -> RunOutcome:
    """Run `config` with `seed` once, in its run folder; KeyboardInterrupt (Ctrl-C, SIGTERM) propagates."""
    name = run_name(config, seed)
    folder = sweep_dir / RUNS / name
    checkpoint, left_folder = _earlier_attempt(folder)
    defaults = _FitDefaults(sweep_dir / RUNS, name, checkpoint_interval, checkpoint, overwrite=left_folder)
    token = _ACTIVE.set(defaults)
    start = time.perf_counter()
    outcome = RunOutcome(seed, "completed", run_dir=f"{RUNS}/{name}",
                         resumed_from=str(checkpoint.relative_to(sweep_dir)) if checkpoint else None)
    given = _Config({**config, "seed": seed})
    try:
        record, extra = _unpack(run(given))
        outcome.metrics = objective.measure(record, extra)
        if not math.isfinite(outcome.metrics["objective"]):
            outcome.status, outcome.error = "diverged", f"the objective is {outcome.metrics['objective']}"
    except FloatingPointError as e:  # exogym stops a run whose loss is nan or inf
        outcome.status, outcome.error = "diverged", f"{type(e).__name__}: {e}"
    except MissingMetricError as e:  # objective.measure: what the run lacks, said plainly
        outcome.status, outcome.error = "failed", f"{MISSING_METRIC}: {e.args[0] if e.args else e}"
    except Exception as e:
        outcome.status = "failed"
        outcome.error = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)[-6:])
    finally:
        _ACTIVE.reset(token)
    outcome.wall_s = time.perf_counter() - start
    if outcome.status == "completed":  # a run that stopped early may not have reached every parameter
        outcome.unread = sorted(set(config) - given.read)
    if not defaults.used or not folder.exists():
        outcome.run_dir = None  # the run function never called fit, or fit wrote no folder (logger=False)
    return outcome


def write_outcome(folder: Path, outcome: RunOutcome) -> None:
    """The outcome as <run folder>/sweep_run.json (the folders' own bookkeeping, when Optuna is not used)."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "sweep_run.json.tmp"
    tmp.write_text(json.dumps(outcome.to_json(), indent=1) + "\n")
    os.replace(tmp, folder / "sweep_run.json")


def read_outcome(folder: Path) -> RunOutcome | None:
    try:
        return RunOutcome.from_json(json.loads((folder / "sweep_run.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def config_status(outcomes: list[RunOutcome], seeds: tuple[int, ...]) -> str:
    """A configuration's status from its seeds' outcomes: failed or diverged if any seed was, completed when
    every seed completed, interrupted otherwise."""
    for status in ("failed", "diverged"):
        if any(o.status == status for o in outcomes):
            return status
    return "completed" if len(outcomes) == len(seeds) else "interrupted"
