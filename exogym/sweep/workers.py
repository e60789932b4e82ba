"""Running a sweep's configurations: one worker loop, in this process or in N worker processes.

A worker runs trials of the study (study.SweepStudy: Optuna's optimize) one after another: each runs its
configuration's seeds (each a run folder; seeds an earlier attempt completed are not run again), records each
seed's outcome as it ends, until the study has none left. workers=N starts N processes (spawned, so each has its own torch and CUDA), each
given its share of the cores (torch.set_num_threads and OMP_NUM_THREADS: cores // N, never more than this
process uses) and, where there are GPUs, one of them (CUDA_VISIBLE_DEVICES, worker i gets GPU i mod count: its
cuda:0). Ctrl-C or SIGTERM in a worker interrupts its configuration (resumed later from its checkpoints);
a worker that dies (SIGKILL, a crash) is noticed by the parent, which fails its trial as interrupted, queues it
again (Optuna's retry callback) and starts a new worker in its place; a worker whose parent dies interrupts
itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from exogym.launch.signals import raise_on_sigterm
from exogym.sweep.objective import Objective
from exogym.sweep.runs import MISSING_METRIC, NO_FOLDER, RUNS, RunLock, RunOutcome, read_outcome, run_seed
from exogym.sweep.space import run_name

__all__ = ["work", "WorkerPool", "cores_available", "check_picklable"]


def cores_available() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_picklable(run: Callable[..., Any]) -> None:
    try:
        pickle.loads(pickle.dumps(run))
    except Exception as e:
        raise TypeError(f"workers > 1 run configurations in separate processes, so the run function must be "
                        f"importable: define {getattr(run, '__qualname__', run)!r} at module level of a .py file "
                        f"(not a lambda or a function inside a function), and start the sweep under "
                        f"`if __name__ == \"__main__\":` ({type(e).__name__}: {e})") from None


def work(study: Any, run: Callable[..., Any], *, objective: Objective, sweep_dir: Path,
         checkpoint_interval: int | None, after_job: Callable[[], None] | None = None) -> None:
    """Run trials of `study` (a SweepStudy) until it has none left; KeyboardInterrupt interrupts the current one."""

    def execute(config: dict, done: dict[int, RunOutcome], record: Callable[[RunOutcome], None]) -> list[RunOutcome]:
        outcomes: list[RunOutcome] = []
        for seed in study.space.seeds:
            outcome = done.get(seed) or _run_locked(config, seed, run, objective=objective,
                                                    sweep_dir=sweep_dir, checkpoint_interval=checkpoint_interval)
            if seed not in done:
                record(outcome)
            outcomes.append(outcome)
            if outcome.status != "completed":
                break  # a diverged or failed seed decides the configuration: the others would be wasted
        return outcomes

    while study.has_work():
        outcomes = study.run_trial(execute)
        if after_job is not None:
            after_job()
        for prefix in (MISSING_METRIC, NO_FOLDER):  # every configuration would fail the same way: stop, say why
            error = next((o.error for o in outcomes or () if o.error and o.error.startswith(prefix)), None)
            if error is not None:
                raise ValueError(error.split(": ", 1)[1])
        unread = next((o.unread for o in outcomes or () if o.unread), None)
        if unread:
            raise ValueError(f"the run function never read {', '.join(f'config[{n!r}]' for n in unread)}: it takes no "
                             f"such parameter (a typo?), so every value would give the same runs; fix the name, or "
                             f"drop it from the space (a parameter only some runs take: join grids with +)")


def _run_locked(config: dict, seed: int, run: Callable[..., Any], **kwargs: Any) -> RunOutcome:
    # Two trials of one configuration (a search may propose a point twice) share its run folders: the second
    # waits for the first, then takes the outcome it left in the run folder instead of running it again.
    name = run_name(config, seed)
    lock = RunLock(kwargs["sweep_dir"], name)
    lock.acquire(wait=True)
    try:
        earlier = read_outcome(kwargs["sweep_dir"] / RUNS / name)
        if earlier is not None and earlier.status in ("completed", "diverged"):
            return earlier
        return run_seed(run, config, seed, **kwargs)
    finally:
        lock.release()


@dataclass
class _WorkerSpec:
    """What a worker process needs (pickled into it): how to open the study, the run function, its share."""

    open_study: Callable[..., Any]
    run: Callable[..., Any]
    objective: Objective
    sweep_dir: Path
    checkpoint_interval: int | None
    threads: int
    index: int = 0  # the worker's number: its sampler's seed is the sweep's plus this (no two propose alike)
    worker_id: str = ""  # marks the trials it runs, so that the parent can interrupt them if it dies


EXIT_WORKER_ERROR = 3  # a worker stopped on an error it printed in one line
EXIT_NO_MAIN_GUARD = 4  # a worker found the sweep script starting a sweep at import (see sweep.sweep)


def _watch_parent(parent: int) -> None:
    """A worker whose sweep process died (SIGKILL) interrupts itself instead of running on alone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(spec: _WorkerSpec) -> None:
    # The parent stops workers with SIGTERM: the launch layer's one handler interrupts the run (RunInterrupted, a
    # KeyboardInterrupt), which records it as stopped by SIGTERM.
    raise_on_sigterm()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(spec.threads)
    try:
        work(spec.open_study(worker=spec.index, worker_id=spec.worker_id), spec.run, objective=spec.objective,
             sweep_dir=spec.sweep_dir, checkpoint_interval=spec.checkpoint_interval)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # one line for the parent to show (the traceback only with --debug in the parent)
        print(f"exogym sweep: worker {spec.index}: {type(e).__name__}: {' '.join(str(e).split())}",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_WORKER_ERROR)


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Set environment variables for a child about to be spawned (it copies the environment at start)."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class WorkerPool:
    """N worker processes; `poll()` says which are still running and reports those that died. A worker that
    died is replaced (its configuration was queued again by the parent), so the sweep still runs on N."""

    def __init__(self, count: int, open_study: Callable[..., Any], run: Callable[..., Any], *, objective: Objective,
                 sweep_dir: Path, checkpoint_interval: int | None, token: str, threads: int | None = None):
        self.threads = threads or max(1, min(torch.get_num_threads(), cores_available() // count))
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.spec = _WorkerSpec(open_study, run, objective, sweep_dir, checkpoint_interval, self.threads)
        self.token = token
        self.context = multiprocessing.get_context("spawn")
        self.procs = [self._start(i, 0) for i in range(count)]
        self.starts = [0] * count
        self._reported: set[tuple[int, int]] = set()

    def worker_id(self, i: int, start: int | None = None) -> str:
        return f"{self.token}:{i}.{self.starts[i] if start is None else start}"

    def _start(self, i: int, start: int) -> Any:
        spec = dataclasses.replace(self.spec, index=i, worker_id=f"{self.token}:{i}.{start}")
        process = self.context.Process(target=_worker_main, args=(spec,), name=f"exogym-sweep-worker-{i}")
        gpu = str(i % self.gpus) if self.gpus else None
        with _environ(OMP_NUM_THREADS=str(self.threads), CUDA_VISIBLE_DEVICES=gpu):
            process.start()
        return process

    def describe(self) -> str:
        gpus = f", GPU i mod {self.gpus} each" if self.gpus else ""
        return f"{len(self.procs)} worker processes x {self.threads} thread{'s' * (self.threads > 1)}{gpus}"

    def poll(self) -> tuple[bool, list[tuple[int, str, int]]]:
        """(whether any worker still runs, (worker, its id, exit status) for each that ended badly since the last
        poll). The caller replaces those it wants replaced (replace)."""
        died = []
        for i, p in enumerate(self.procs):
            if p.exitcode not in (None, 0) and (i, self.starts[i]) not in self._reported:
                self._reported.add((i, self.starts[i]))
                died.append((i, self.worker_id(i), p.exitcode))
        return any(p.is_alive() for p in self.procs), died

    def replace(self, i: int) -> None:
        self.starts[i] += 1
        self.procs[i] = self._start(i, self.starts[i])

    @staticmethod
    def how(exitcode: int) -> str:
        return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit status {exitcode}"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM every worker (each interrupts its configuration), then SIGKILL any still there after timeout."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
