"""sweep(): check everything, create (or resume) the sweep folder, run the configurations, write the results.

The sweep folder:

    sweep.json       the sweep's definition (space, seeds, objective, search, where the study lives); created
                     with O_EXCL, so a sweep folder is never overwritten and two starts never share one
    study.db         the Optuna study (SQLite), unless storage= names another database
    runs/<name>/     one normal run folder per configuration and seed: config.json, train.csv, val.csv,
                     summary.json, checkpoints/ (name: "H=30,outer_lr=0.6,seed=0")
    .locks/<name>    one lock file per run (runs.RunLock)
    results.csv, results.md, frontier.png, heatmap.png   written when the sweep ends (and on every resume)
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from exogym.sweep.folders import FolderLedger
from exogym.sweep.objective import Objective
from exogym.sweep.progress import SweepProgress
from exogym.sweep.report import SweepResult
from exogym.sweep.space import Space
from exogym.sweep.study import StudyLedger, import_optuna
from exogym.sweep.workers import WorkerPool, check_picklable, work

__all__ = ["sweep", "load", "SweepResult", "SEARCHES"]

SEARCHES = ("grid", "random", "tpe")
_DEFINITION = "sweep.json"


@dataclass
class Definition:
    """What sweep.json holds: everything needed to resume or join the sweep, or to read its results."""

    folder: str
    space: Space
    objective: Objective
    search: str
    trials: int | None
    storage: str  # an SQL URL for Optuna, "default" (SQLite: <folder>/study.db), or "folders" (no Optuna)
    study_name: str
    sampler_seed: int
    checkpoint_interval: int | None
    run: str  # "module:qualname" of the run function (or of a callable object's class)
    run_repr: str = ""  # a callable object's repr (its settings), compared on resume
    command: list[str] | None = None  # a CLI sweep: its fixed part (see cli_sweep)
    flags: dict[str, str] = field(default_factory=dict)  # a CLI sweep: parameter -> option
    argv: list[str] | None = None  # a CLI sweep: its command line, which --resume parses again

    def open_ledger(self, *, create: bool = False, worker: int = 0) -> Any:
        """The sweep's bookkeeping; worker i's sampler is seeded sampler_seed + i, so that workers starting
        together do not propose the same configurations."""
        if self.storage == "folders":
            return FolderLedger(Path(self.folder), self.space)
        return StudyLedger(self.url, self.study_name, self.space, self.objective, search=self.search,
                           trials=self.trials, sampler_seed=self.sampler_seed + worker, create=create)

    @property
    def url(self) -> str:
        return f"sqlite:///{Path(self.folder) / 'study.db'}" if self.storage == "default" else self.storage

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "space": self.space.to_json(), "objective": self.objective.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Definition":
        return cls(**{**data, "space": Space.from_json(data["space"]),
                      "objective": Objective.from_json(data["objective"])})

    def load_run(self) -> Callable[..., Any]:
        module, _, name = self.run.partition(":")
        try:
            target: Any = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
            if self.run_repr:
                raise ImportError  # a callable object: its settings cannot be rebuilt from here
        except (ImportError, AttributeError):
            raise ValueError(f"this sweep runs {self.run!r}, which cannot be imported from here; rerun the script "
                             "that started it with resume=True") from None
        return target


def _check(run: Callable[..., Any], space: Space, search: str | None, trials: int | None, workers: int,
           checkpoint_interval: int | None) -> str:
    if not callable(run):
        raise TypeError(f"run must be a function config -> trainer.record, got {type(run).__name__}")
    if not isinstance(space, Space):
        raise TypeError(f"space must be grid(...) or space(...) from exogym.sweep, got {type(space).__name__}")
    search = search or ("grid" if space.is_grid else None)
    if search is None:
        space.configurations()  # raises, naming the ranges and the fix
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {list(SEARCHES)}, got {search!r}")
    if search == "grid":
        if trials is not None:
            raise ValueError(f"a grid runs every configuration ({len(space.configurations())}); trials= is for "
                             "search='random' or 'tpe'")
        space.configurations()
    else:
        import_optuna(f"search={search!r}")
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise ValueError(f"search={search!r} needs trials=N, a number of configurations >= 1, got {trials!r}")
        space.branch()
    for name, value, low in (("workers", workers, 1), ("checkpoint_interval", checkpoint_interval, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if workers > 1:
        check_picklable(run)
    return search


def _describe(run: Callable[..., Any]) -> tuple[str, str]:
    """("module:qualname", repr of a callable object's settings or "") of the run function."""
    if inspect.isfunction(run) or inspect.ismethod(run) or inspect.isclass(run) or inspect.isbuiltin(run):
        return f"{run.__module__}:{run.__qualname__}", ""
    return f"{type(run).__module__}:{type(run).__qualname__}", repr(run)


def _claim(folder: Path, definition: Definition) -> None:
    """Create the sweep folder's sweep.json, atomically; an existing sweep or other files stop the sweep."""
    if (folder / _DEFINITION).exists():
        raise ValueError(f"{str(folder)!r} holds a sweep already; resume it (resume=True, or exogym sweep "
                              f"--resume {folder}), or give another out=")
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{str(folder)!r} is not empty and holds no sweep; give another out= (a sweep folder "
                              "is never written over)")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(folder / _DEFINITION, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise ValueError(f"{str(folder)!r} was claimed by another sweep starting at the same time; resume it "
                              "or give another out=") from None
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(definition.to_json(), indent=1) + "\n")


def read_definition(folder: str | os.PathLike) -> Definition:
    path = Path(folder) / _DEFINITION
    if not path.exists():
        raise FileNotFoundError(f"{str(folder)!r} holds no sweep (no {_DEFINITION}); start one there instead")
    definition = Definition.from_json(json.loads(path.read_text()))
    definition.folder = str(Path(folder).resolve())  # where it is now (a sweep folder may be moved or copied)
    return definition


def _check_same(stored: Definition, given: Definition) -> None:
    diffs = [f"{what}: stored {a} , given {b}" for what, a, b in (
        ("space", stored.space.describe(), given.space.describe()),
        ("objective", stored.objective.describe(), given.objective.describe()),
        ("search", stored.search, given.search),
        ("run function", stored.run.split(":")[-1], given.run.split(":")[-1]),  # a script's module is __main__
        ("run function's settings", stored.run_repr, given.run_repr)) if a != b]
    if stored.search != "grid" and given.trials is not None and given.trials < (stored.trials or 0):
        diffs.append(f"trials: stored {stored.trials}, given {given.trials} (a search may be extended, not cut)")
    if diffs:
        raise ValueError(f"the sweep in {stored.folder!r} was started differently; resuming it with other settings "
                         f"would mix two experiments: {'; '.join(diffs)}. Resume with the same settings, or give "
                         "another out=")


def sweep(run: Callable[[dict[str, Any]], Any], space: Space, *, out: str | os.PathLike, search: str | None = None,
          trials: int | None = None, objective: str = "val_loss", direction: str | None = None,
          budget_bytes: float | str | None = None, budget_sim_time: float | None = None,
          max_bytes: float | str | None = None, max_sim_time: float | None = None,
          extra_metrics: Sequence[str] = (), workers: int = 1, resume: bool = False, retry_failed: bool = False,
          storage: str | None = None, checkpoint_interval: int | None = None, sampler_seed: int = 0,
          progress: bool = True, _command: tuple[list[str], dict[str, str], list[str]] | None = None) -> SweepResult:
    """Run `run(config)` for every configuration of `space` (a grid) or for `trials` configurations a search
    proposes, each with every seed; return the results (also written into `out`).

    run(config) -> trainer.record (or (record, {metric: value})): builds a Trainer and calls fit with the
        configuration's values (config["seed"] included); its run folder lands under out/runs/ by itself.
    search: "grid" (the default for a space of lists), "random" or "tpe" (Optuna's samplers; need trials=).
    objective: a summary metric to minimise (direction="maximize" to maximise; accuracy is maximised by
        default), read at a budget (budget_bytes, budget_sim_time) or under constraints (max_bytes,
        max_sim_time); exogym.sweep.objective explains each. extra_metrics: names of metrics the run function
        returns beside the record, when one is the objective.
    workers: configurations run at once, each in its own process with its share of the cores (and a GPU).
    resume: continue the sweep in `out` (or join it from another process or machine): finished configurations
        are never run again, interrupted ones continue from their last checkpoint (checkpoint_interval=N steps
        saves them), failed ones are run again only with retry_failed=True.
    storage: where the Optuna study lives (default: SQLite in out/study.db; any SQL URL for several machines);
        without Optuna installed, a grid is kept in its run folders.
    """
    folder = Path(out).resolve()
    search = _check(run, space, search, trials, workers, checkpoint_interval)
    goal = Objective(objective, direction, budget_bytes, budget_sim_time, max_bytes, max_sim_time,
                     tuple(extra_metrics))
    if storage is None:
        try:
            import_optuna("the study")
            storage = "default"
        except ImportError:
            storage = "folders"  # a grid without Optuna: its run folders are the bookkeeping
    given = Definition(str(folder), space, goal, search, trials, storage, f"exogym-{folder.name}-{uuid.uuid4().hex[:8]}",
                       sampler_seed, checkpoint_interval, *_describe(run), *(_command or (None, {}, None)))
    if resume:
        definition = read_definition(folder)
        _check_same(definition, given)
        if trials is not None and definition.search != "grid":
            definition.trials = trials
            (folder / _DEFINITION).write_text(json.dumps(definition.to_json(), indent=1) + "\n")
        ledger = definition.open_ledger()
        dead, queued = ledger.mark_dead(), ledger.requeue(retry_failed)
        if progress and (dead or queued):
            print(f"exogym sweep: {dead} interrupted configuration(s) found, {queued} queued to run again", flush=True)
    else:
        definition = given
        _claim(folder, definition)
        ledger = definition.open_ledger(create=True)
    return _run(definition, ledger, run, workers, progress)


def _run(definition: Definition, ledger: Any, run: Callable[..., Any], workers: int, progress: bool) -> SweepResult:
    folder = Path(definition.folder)
    result = SweepResult(definition, ledger)
    if progress:
        where = "run folders (Optuna not installed)" if definition.storage == "folders" else definition.url
        size = f"{ledger.total()} configurations" if definition.search == "grid" else \
            f"{definition.search} search, {definition.trials} trials"
        print(f"exogym sweep {folder}: {size} x {len(definition.space.seeds)} seed(s); objective "
              f"{definition.objective.describe()}; study: {where}", flush=True)
    bar = SweepProgress(result, ledger.total(), enabled=progress)
    kwargs = dict(objective=definition.objective, sweep_dir=folder, checkpoint_interval=definition.checkpoint_interval)
    try:
        if workers == 1:
            work(ledger, run, after_job=bar.refresh, **kwargs)
        else:
            pool = WorkerPool(workers, definition.open_ledger, run, **kwargs)
            if progress:
                print(f"exogym sweep: {pool.describe()}", flush=True)
            try:
                while True:
                    alive, died = pool.poll()
                    for line in died:
                        bar.write(f"exogym sweep: {line}; its configuration is interrupted and reruns on --resume")
                    if died:
                        ledger.mark_dead()
                    bar.refresh()
                    if not alive:
                        break
                    time.sleep(1.0)
            except BaseException:
                pool.stop()
                ledger.mark_dead()
                raise
    except KeyboardInterrupt:
        bar.close()
        print(f"\nexogym sweep: interrupted; finished configurations are kept. Resume: resume=True (exogym sweep "
              f"--resume {folder})", flush=True)
        raise
    bar.refresh()
    bar.close()
    result.write(announce=progress)
    return result


def load(folder: str | os.PathLike) -> SweepResult:
    """The results of the sweep in `folder` (finished or not), without running anything."""
    definition = read_definition(Path(folder).resolve())
    if definition.storage != "folders":
        import_optuna(f"reading the sweep in {str(folder)!r}")
    return SweepResult(definition, definition.open_ledger())

