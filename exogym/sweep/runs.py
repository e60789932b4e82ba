"""One run of a sweep: a configuration with one seed, as a normal run folder under the sweep folder.

The user's run function is called as `run(config, run)`: `config` holds the configuration's values and its
seed, `run` is a SweepRun, the run's settings from the sweep, handed over explicitly. The function passes them
on to fit: `trainer.fit(strategy, nodes, ..., **run.fit_kwargs)` gives fit a CSVLogger writing
`<sweep>/runs/<run name>/`, checkpoints in its `checkpoints/` every `checkpoint_interval` steps, `resume_from=`
the last checkpoint an earlier attempt left (the run continues bit-identically), `overwrite=True` when an
earlier attempt left a folder without one (it starts again), and `progress=False` (the sweep shows its own bar).

How a run ends: "completed"; "diverged" (a nan/inf loss: FloatingPointError, or a nan objective), "failed"
(any other exception, with its message). Ctrl-C and SIGTERM propagate as KeyboardInterrupt: the run is
interrupted, and continues from its checkpoint when the sweep resumes. The outcome is written into the run
folder (`sweep_run.json`) before it goes to the study, so an outage of the study's storage never loses it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from exogym.runs.checkpoint import CheckpointError, find_checkpoint
from exogym.runs.loggers import CSVLogger
from exogym.sweep.objective import MissingMetricError, Objective
from exogym.sweep.space import Value, run_name
from exogym.sweep.storage import writing

__all__ = ["MISSING_METRIC", "NO_FOLDER", "RunOutcome", "SweepRun", "run_seed", "RunLock", "config_status",
           "write_outcome", "read_outcome", "RUNS", "LOCKS"]

RUNS, LOCKS = "runs", ".locks"  # under the sweep folder: the run folders, and one lock file per run
MISSING_METRIC = "MissingMetric"  # how an outcome's error starts when the run lacks what the objective reads
NO_FOLDER = "NoRunFolder"  # how it starts when the run function did not pass run.fit_kwargs on to fit


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


@dataclass(frozen=True)
class SweepRun:
    """The settings the sweep gives one run, handed to the run function as its second argument.

    Attributes:
        name: The run's name, "H=30,outer_lr=0.6,seed=0": its folder under `<sweep>/runs/`.
        folder: The run folder (fit's CSVLogger writes it); save more into it (a model, samples).
        seed: The run's seed (also config["seed"]).
        checkpoint_interval: Steps between checkpoints (the sweep's checkpoint_interval=), or None.
        resume_from: The last checkpoint an earlier attempt of this run left (None: the run starts afresh).
        overwrite: Whether an earlier attempt left a folder without a checkpoint (fit starts the run again).
    """

    name: str
    folder: Path
    seed: int
    checkpoint_interval: int | None = None
    resume_from: Path | None = None
    overwrite: bool = False

    @property
    def fit_kwargs(self) -> dict[str, Any]:
        """What to pass on to `trainer.fit(...)`: logger (a CSVLogger writing `folder`), progress=False, and the
        checkpoint settings (checkpoint_interval, checkpoint_dir, resume_from or overwrite) where they apply."""
        kwargs: dict[str, Any] = {"logger": CSVLogger(self.folder.parent, self.name), "progress": False}
        if self.checkpoint_interval is not None:
            kwargs["checkpoint_interval"] = self.checkpoint_interval
        if self.checkpoint_interval is not None or self.resume_from is not None:
            kwargs["checkpoint_dir"] = self.folder / "checkpoints"
        if self.resume_from is not None:
            kwargs["resume_from"] = self.resume_from
        elif self.overwrite:
            kwargs["overwrite"] = True
        return kwargs


class RunLock:
    """The lock of one run: an flock on <sweep>/.locks/<run name>, which the kernel drops when its holder dies
    (SIGKILL included), so a lock is never left stale. Two workers never run the same run at once."""

    def __init__(self, sweep_dir: Path, name: str):
        self.path = sweep_dir / LOCKS / name
        self._fd: int | None = None

    def acquire(self, *, wait: bool) -> bool:
        """Take the lock; with wait=False return False at once if another holder has it."""
        with writing(self.path, "the run's lock"):
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


def run_seed(run: Callable[..., Any], config: Mapping[str, Value], seed: int, *, sweep_dir: Path,
             objective: Objective, checkpoint_interval: int | None) -> RunOutcome:
    """Run `config` with `seed` once, in its run folder, and write its outcome there (sweep_run.json);
    KeyboardInterrupt (Ctrl-C, SIGTERM) propagates."""
    name = run_name(config, seed)
    folder = sweep_dir / RUNS / name
    checkpoint, left_folder = _earlier_attempt(folder)
    settings = SweepRun(name, folder, seed, checkpoint_interval, checkpoint, overwrite=left_folder)
    start = time.perf_counter()
    outcome = RunOutcome(seed, "completed", run_dir=f"{RUNS}/{name}",
                         resumed_from=str(checkpoint.relative_to(sweep_dir)) if checkpoint else None)
    given = _Config({**config, "seed": seed})
    try:
        record, extra = _unpack(run(given, settings))
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
    outcome.wall_s = time.perf_counter() - start
    if outcome.status == "completed":  # a run that stopped early may not have reached every parameter
        outcome.unread = sorted(set(config) - given.read)
    if outcome.status == "completed" and not (folder / "summary.json").exists():
        outcome.status = "failed"  # every run would write nowhere: the sweep stops after this one (workers.work)
        outcome.error = (f"{NO_FOLDER}: the run wrote no run folder {folder}: pass the sweep's settings on to fit, "
                         "trainer.fit(..., **run.fit_kwargs) (run: the run function's second argument)")
    if not folder.exists():
        outcome.run_dir = None
    else:
        write_outcome(folder, outcome)
    return outcome


def write_outcome(folder: Path, outcome: RunOutcome) -> None:
    """The outcome as <run folder>/sweep_run.json, written before it goes to the study (an outage loses nothing)."""
    with writing(folder / "sweep_run.json", "the run's outcome"):
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
