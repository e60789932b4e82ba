"""sweep(): check everything, create (or resume, or join) the sweep, run its trials, write the results.

The sweep folder:

    sweep.json       the sweep's definition (space, seeds, objective, search, workers, where the study lives);
                     the same definition is kept on the study (user attribute exogym_sweep), so that another
                     machine joining the study is checked against it
    study.journal    the Optuna study (a JournalStorage file), unless storage= names a database
    runs/<name>/     one normal run folder per configuration and seed: config.json, train.csv, val.csv,
                     summary.json, checkpoints/, sweep_run.json (name: "H=30,outer_lr=0.6,seed=0")
    .locks/<name>    one lock file per run (runs.RunLock); .lock: held by the process running a journal sweep
    results.csv, results.md, frontier.png, heatmap.png   written when the sweep ends (and on every resume)

A start that fails or is interrupted before the study is ready removes what it made, so the same command can
be given again; one killed outright leaves sweep.json, and `resume` finishes the setup (queueing a grid
continues where it stopped).
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from exogym.sweep.definition import DEFINITION, Definition, check_same, read_definition, write_json
from exogym.sweep.objective import Objective
from exogym.sweep.progress import SweepProgress
from exogym.sweep.report import SweepResult
from exogym.sweep.runs import RUNS
from exogym.sweep.space import Space
from exogym.sweep.storage import JOURNAL, StorageUnavailable, SweepStopped, check_url, disk_error, import_optuna
from exogym.sweep.study import SweepStudy
from exogym.sweep.workers import (EXIT_NO_MAIN_GUARD, EXIT_WORKER_ERROR, WorkerPool, check_picklable,
                                  cores_available, work)

__all__ = ["sweep", "load", "SweepResult", "SEARCHES"]

SEARCHES = ("grid", "random", "tpe")
NO_MAIN_GUARD = ("the sweep script starts a sweep when it is imported, and every worker process imports it: put "
                 "the sweep(...) call under `if __name__ == \"__main__\":`")


def _int(name: str, value: Any, low: int) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _check(run: Callable[..., Any], space: Space, search: str | None, trials: int | None, workers: int | None,
           checkpoint_interval: int | None, storage: str | None) -> str:
    if not callable(run):
        raise TypeError(f"run must be a function (config, run) -> trainer.record, got {type(run).__name__}")
    _check_signature(run)
    if not isinstance(space, Space):
        raise TypeError(f"space must be grid(...) or space(...) from exogym.sweep, got {type(space).__name__}")
    search = search or ("grid" if space.is_grid else None)
    if search is None:
        space.count()  # raises, naming the ranges and the fix
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {list(SEARCHES)}, got {search!r}")
    import_optuna(f"a sweep (search={search!r})")
    if search == "grid":
        count = space.count()
        if trials is not None:
            raise ValueError(f"a grid runs every configuration ({count}); trials= is for search='random' or 'tpe'")
    else:
        if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
            raise ValueError(f"search={search!r} needs trials=N, a number of configurations >= 1, got {trials!r}")
        space.branch()
    _int("workers", workers, 1)
    _int("checkpoint_interval", checkpoint_interval, 1)
    if storage is not None:
        check_url(storage)
        if storage.startswith("sqlite") and (workers or 1) > 1:
            raise ValueError(f"storage {storage!r}: SQLite cannot hand trials to several processes safely (two could "
                             "take the same one); leave storage out (a journal file in the sweep folder, made for "
                             "several processes on one machine), or use a database server URL")
    if (workers or 1) > 1:
        check_picklable(run)
    return search


def _check_signature(run: Callable[..., Any]) -> None:
    try:
        inspect.signature(run).bind(object(), object())
    except TypeError:
        raise TypeError(f"the run function is called as run(config, run): config holds the configuration's values, "
                        f"run is its SweepRun, whose settings it passes on to fit (trainer.fit(..., "
                        f"**run.fit_kwargs)); {getattr(run, '__qualname__', run)!r} does not take two arguments") \
            from None
    except ValueError:  # no signature (a builtin): let the call say
        pass


def _describe(run: Callable[..., Any]) -> tuple[str, str]:
    """("module:qualname", repr of a callable object's settings or "") of the run function."""
    if inspect.isfunction(run) or inspect.ismethod(run) or inspect.isclass(run) or inspect.isbuiltin(run):
        return f"{run.__module__}:{run.__qualname__}", ""
    return f"{type(run).__module__}:{type(run).__qualname__}", repr(run)


def _claim(folder: Path, definition: Definition) -> bool:
    """Write the sweep folder's sweep.json, atomically; an existing sweep or other files stop the sweep. Returns
    whether the folder was made here (a failed start removes it)."""
    if (folder / DEFINITION).exists():
        raise ValueError(f"{str(folder)!r} holds a sweep already; resume it (resume=True, or exogym sweep "
                         f"--resume {folder}), or give another out=")
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"{str(folder)!r} is not empty and holds no sweep; give another out= (a sweep folder "
                         "is never written over)")
    made = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot make the sweep folder {folder}: {disk_error(e)}") from None
    try:
        write_json(folder / DEFINITION, definition.to_json(), exclusive=True)
    except FileExistsError:
        raise ValueError(f"{str(folder)!r} was claimed by another sweep starting at the same time; resume it "
                         "or give another out=") from None
    return made


def _unclaim(folder: Path, made: bool) -> None:
    """Undo a start that failed: what it wrote (a folder made here goes whole; nothing else was in it)."""
    if made:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        for name in (DEFINITION, JOURNAL, ".lock", ".locks", "runs"):
            path = folder / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


@contextlib.contextmanager
def _folder_lock(definition: Definition) -> Iterator[None]:
    """A journal sweep is run by one process (with its workers) at a time: an flock on <folder>/.lock, which the
    kernel drops when the process dies. So every RUNNING trial found by the holder is one whose worker is gone."""
    if definition.storage != "default":
        yield
        return
    fd = os.open(definition.path / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"the sweep in {definition.folder} is being run by another process now; wait for it, or "
                             "stop it and resume with more workers (resume=True, workers=N); several processes or "
                             "machines at once need a database storage (storage='postgresql://...')") from None
        yield
    finally:
        os.close(fd)


def sweep(run: Callable[[dict[str, Any], Any], Any], space: Space, *, out: str | os.PathLike,
          search: str | None = None, trials: int | None = None, objective: str = "val_loss",
          direction: str | None = None, budget_bytes: float | str | None = None,
          budget_sim_time: float | None = None, max_bytes: float | str | None = None,
          max_sim_time: float | None = None, extra_metrics: Sequence[str] = (), workers: int | None = None,
          resume: bool = False, retry_failed: bool = False, storage: str | None = None, study_name: str | None = None,
          checkpoint_interval: int | None = None, sampler_seed: int = 0, heartbeat: int = 10, grace: int = 60,
          max_retry: int = 2, storage_patience: float = 600.0, progress: bool = True,
          _command: tuple[list[str], dict[str, str], list[str]] | None = None) -> SweepResult:
    """Run `run(config, run)` for every configuration of `space` (a grid) or for `trials` configurations a search
    proposes, each with every seed; return the results (also written into `out`).

    Args:
        run: Called as run(config, run) for each configuration and seed: config holds the values (config["seed"]
            included), run is the run's SweepRun; it builds a Trainer, calls trainer.fit(..., **run.fit_kwargs)
            and returns trainer.record (or (record, {metric: value})).
        space: grid(...) or space(...).
        out: The sweep folder (never written over; resume=True continues it).
        search: "grid" (the default for a space of lists), "random" or "tpe" (Optuna's samplers; need trials=).
        trials: Configurations a search runs.
        objective: A summary metric to minimise (direction="maximize" to maximise; accuracy is maximised by
            default), read at a budget (budget_bytes, budget_sim_time) or under constraints (max_bytes,
            max_sim_time); exogym.sweep.objective explains each. extra_metrics: names of metrics the run function
            returns beside the record, when one is the objective.
        workers: Configurations run at once, each in its own process with its share of the cores (and a GPU);
            default 1, and on resume the sweep's own.
        resume: Continue the sweep in `out`: finished configurations are never run again, interrupted ones continue
            from their last checkpoint (checkpoint_interval=N steps saves them), failed ones are run again only
            with retry_failed=True.
        storage: Where the Optuna study lives: default a journal file in out/; a database URL
            (postgresql://user@host/db) for several machines, each running the same sweep with its own out= and
            the same study_name= (default: out's folder name).
        heartbeat, grace, max_retry: A database's heartbeat (s), the silence (s) after which a trial is failed as
            stale, and how often a configuration whose worker died is queued again.
        storage_patience: Seconds a worker retries an unreachable storage (with backoff) before it gives up.

    Returns:
        The SweepResult (table, best, frontier).

    Raises:
        ValueError, TypeError, ImportError: a setting that cannot work, before any trial starts.
        StorageUnavailable: the storage stayed unreachable for storage_patience seconds.
    """
    if multiprocessing.current_process().name.startswith("exogym-sweep-worker"):
        sys.exit(EXIT_NO_MAIN_GUARD)  # a worker importing a script without the main guard: the parent says so
    folder = _folder(out)
    search = _check(run, space, search, trials, workers, checkpoint_interval, storage)
    for name, value in (("heartbeat", heartbeat), ("grace", grace), ("max_retry", max_retry)):
        _int(name, value, 0 if name == "max_retry" else 1)
    goal = Objective(objective, direction, budget_bytes, budget_sim_time, max_bytes, max_sim_time,
                     tuple(extra_metrics))
    name = study_name or (f"exogym-{folder.name}" if storage is not None else "exogym-sweep")
    given = Definition(str(folder), space, goal, search, trials, storage or "default", name, sampler_seed,
                       checkpoint_interval, *_describe(run), *(_command or (None, {}, None)),
                       workers=workers or 1, heartbeat=heartbeat, grace=grace, max_retry=max_retry,
                       storage_patience=storage_patience)
    if resume:
        definition = read_definition(folder)
        check_same(definition, given, repr(str(folder)))
        definition.trials = trials if trials is not None and definition.search != "grid" else definition.trials
        definition.workers = workers or definition.workers
        if workers is not None:
            definition.threads = _threads(definition.workers)
        write_json(folder / DEFINITION, definition.to_json(), exclusive=False)
        made = None
    else:
        definition = given
        definition.threads = _threads(definition.workers)
        if progress:
            _say_size(definition)
        made = _claim(folder, definition)
    try:
        with _folder_lock(definition):
            study = _set_up(definition, given, resume=resume, retry_failed=retry_failed, progress=progress)
            made = None  # the study is ready: from here on the folder is a sweep to resume
            return _run(definition, study, run, progress)
    except BaseException:
        if made is not None:
            _unclaim(folder, made)
        raise


def _folder(out: Any) -> Path:
    if not isinstance(out, (str, os.PathLike)) or not str(out):
        raise TypeError(f"out must be the sweep folder, a path (str or pathlib.Path), got {out!r}")
    return Path(out).resolve()


def _threads(workers: int) -> int:
    return torch.get_num_threads() if workers == 1 else max(1, min(torch.get_num_threads(),
                                                                   cores_available() // workers))


def _say_size(definition: Definition) -> None:
    seeds = len(definition.space.seeds)
    if definition.search == "grid":
        count = definition.space.count()
        size = f"{count:,} configurations x {seeds} seed(s) = {count * seeds:,} runs"
    else:
        size = f"{definition.search} search, {definition.trials} configurations x {seeds} seed(s)"
    print(f"exogym sweep {definition.folder}: {size}; objective {definition.objective.describe()}; study: "
          f"{definition.shown_storage}", flush=True)


def _set_up(definition: Definition, given: Definition, *, resume: bool, retry_failed: bool,
            progress: bool) -> SweepStudy:
    """Open (or create) the study, check a study made elsewhere is this sweep, queue the grid, requeue what a
    resume runs again."""
    study = definition.open_study(create=True)
    if resume:
        _check_study_holds_runs(definition, study)
    if study.created:  # before the definition: a machine joining the study finds the queue once it finds that
        study.queue_grid()
    stored = None if study.created else study.stored_definition(wait=30.0)
    if stored is None:
        study.describe_as({k: v for k, v in definition.to_json().items() if k != "folder"})
    else:
        check_same(Definition.from_json({**stored, "folder": definition.folder}), given,
                    f"study {definition.study_name!r} of {definition.shown_storage}")
    study.open_pareto()  # the loss-vs-bytes view: made with the study (a study made before it gets it here)
    if resume:
        if definition.storage == "default":
            dead = study.interrupt_running()  # this process holds the folder lock: nobody else runs them
        else:
            study.fail_stale()  # Optuna's heartbeat: trials whose worker went silent are failed and queued again
            dead = 0
        queued = study.requeue(retry_failed)
        if progress and (dead or queued):
            print(f"exogym sweep: {dead + queued} interrupted configuration(s) queued to run again", flush=True)
    if resume:  # a resume continues a queue that stopped (or a setup killed before it queued)
        study.queue_grid()
    return study


def _check_study_holds_runs(definition: Definition, study: SweepStudy) -> None:
    """A resumed sweep's study must account for every run folder the sweep made: one that holds less (a journal
    emptied, deleted or cut, sweep.json's storage pointed elsewhere) would run the sweep again beside them."""
    runs = definition.path / RUNS
    folders = sorted(p.name for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else []
    unknown = [name for name in folders if name not in study.run_names()] if folders else []
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise SweepStopped(f"the study in {definition.shown_storage} holds less than the run folders in {runs} show: "
                           f"{len(unknown)} of {len(folders)} run(s) are not in it ({shown}); the study was damaged, "
                           f"emptied or replaced (or sweep.json's storage points elsewhere). Nothing was run: restore "
                           f"the study, or start a new sweep with another out= (the run folders are kept)")


def _run(definition: Definition, study: SweepStudy, run: Callable[..., Any], progress: bool) -> SweepResult:
    folder = definition.path
    result = SweepResult(definition, study)
    bar = SweepProgress(result, study.total(), enabled=progress)
    kwargs = dict(objective=definition.objective, sweep_dir=folder, checkpoint_interval=definition.checkpoint_interval)
    try:
        if definition.workers == 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(definition.threads)  # a resume runs with the threads the sweep ran with
            try:
                work(definition.open_study(worker_id=f"{uuid.uuid4().hex[:8]}:0.0"), run, after_job=bar.refresh,
                     **kwargs)
            finally:
                torch.set_num_threads(threads)
        else:
            _run_pool(definition, study, run, bar, progress, kwargs)
    except KeyboardInterrupt:
        bar.close()
        print(f"\nexogym sweep: interrupted; finished configurations are kept. Resume: resume=True (exogym sweep "
              f"--resume {folder})", flush=True)
        raise
    bar.refresh()
    bar.close()
    result.write(announce=progress)
    return result


def _run_pool(definition: Definition, study: SweepStudy, run: Callable[..., Any], bar: SweepProgress,
              progress: bool, kwargs: dict[str, Any]) -> None:
    pool = WorkerPool(definition.workers, definition.open_study, run, token=uuid.uuid4().hex[:8],
                      threads=definition.threads, **kwargs)
    if progress:
        print(f"exogym sweep: {pool.describe()}", flush=True)
    try:
        while True:
            alive, died = pool.poll()
            for i, worker_id, code in died:
                if code == EXIT_NO_MAIN_GUARD:
                    raise SweepStopped(NO_MAIN_GUARD)
                if code == EXIT_WORKER_ERROR:  # it printed its error; every worker would meet it
                    raise SweepStopped(f"worker {i} stopped on the error above; the sweep stops (resume it once "
                                       "that is fixed)")
                queued = study.interrupt_running(worker_id)
                if code == 130:  # Ctrl-C or SIGTERM: it interrupted its configuration itself
                    bar.write(f"exogym sweep: worker {i} was interrupted; its configuration reruns on resume")
                    continue
                bar.write(f"exogym sweep: worker {i} ended with {pool.how(code)}; its configuration "
                          f"{'is queued again' if queued else 'had finished'}, and a new worker takes its place")
                pool.replace(i)
                alive = True
            bar.refresh()
            if not alive:
                break
            time.sleep(0.5)
    except BaseException:
        pool.stop()
        if definition.storage == "default":
            study.interrupt_running()
        raise


def load(folder: str | os.PathLike) -> SweepResult:
    """The results of the sweep in `folder` (finished or not), without running anything."""
    definition = read_definition(_folder(folder))
    return SweepResult(definition, definition.open_study())


__all__ += ["StorageUnavailable", "SweepStopped"]
