"""Running a sweep's configurations: one worker loop, in this process or in N worker processes.

A worker takes a configuration from the ledger, runs its seeds one after another (each a run folder; seeds an
earlier attempt completed are not run again), records each seed's outcome as it ends, and takes the next,
until the ledger has none. workers=N starts N processes (spawned, so each has its own torch and CUDA), each
given its share of the cores (torch.set_num_threads and OMP_NUM_THREADS: cores // N, never more than this
process uses) and, where there are GPUs, one of them (CUDA_VISIBLE_DEVICES, worker i gets GPU i mod count: its
cuda:0). Ctrl-C or SIGTERM in a worker interrupts its configuration (resumed later from its checkpoints);
a worker that dies (SIGKILL, a crash) is noticed by the parent, which marks its configuration interrupted, and
a worker whose parent dies interrupts itself.
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

from exogym.sweep.objective import Objective
from exogym.sweep.runs import MISSING_METRIC, RunLock, RunOutcome, run_seed
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


def work(ledger: Any, run: Callable[..., Any], *, objective: Objective, sweep_dir: Path,
         checkpoint_interval: int | None, after_job: Callable[[], None] | None = None) -> None:
    """Take configurations from `ledger` until it has none; KeyboardInterrupt interrupts the current one."""
    while (job := ledger.next_job()) is not None:
        outcomes: list[RunOutcome] = []
        try:
            done = ledger.done_runs(job)
            for seed in job.seeds:
                outcome = done.get(seed) or _run_locked(ledger, job, seed, run, objective=objective,
                                                        sweep_dir=sweep_dir, checkpoint_interval=checkpoint_interval)
                outcomes.append(outcome)
                if outcome.status != "completed":
                    break  # a diverged or failed seed decides the configuration: the others would be wasted
        except BaseException:
            ledger.interrupt(job)
            raise
        ledger.finish(job, outcomes)
        if after_job is not None:
            after_job()
        missing = next((o.error for o in outcomes if o.error and o.error.startswith(MISSING_METRIC)), None)
        if missing is not None:  # every configuration would fail the same way: stop, and say why
            raise ValueError(missing.split(": ", 1)[1])
        unread = next((o.unread for o in outcomes if o.unread), None)
        if unread:
            raise ValueError(f"the run function never read {', '.join(f'config[{n!r}]' for n in unread)}: it takes no "
                             f"such parameter (a typo?), so every value would give the same runs; fix the name, or "
                             f"drop it from the space (a parameter only some runs take: join grids with +)")


def _run_locked(ledger: Any, job: Any, seed: int, run: Callable[..., Any], **kwargs: Any) -> RunOutcome:
    if job.held is not None:  # the folder ledger handed out this run with its lock
        outcome = run_seed(run, job.config, seed, **kwargs)
    else:
        # Two trials of one configuration (a search may ask for a point twice) share its run folders: the second
        # waits for the first, then takes its outcome instead of running it again.
        lock = RunLock(kwargs["sweep_dir"], run_name(job.config, seed))
        lock.acquire(wait=True)
        try:
            outcome = ledger.done_runs(job).get(seed) or run_seed(run, job.config, seed, **kwargs)
        finally:
            lock.release()
    ledger.record_run(job, outcome)
    return outcome


@dataclass
class _WorkerSpec:
    """What a worker process needs (pickled into it): how to open the ledger, the run function, its share."""

    open_ledger: Callable[[], Any]
    run: Callable[..., Any]
    objective: Objective
    sweep_dir: Path
    checkpoint_interval: int | None
    threads: int
    index: int = 0  # the worker's number: its sampler's seed is the sweep's plus this (no two propose alike)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _watch_parent(parent: int) -> None:
    """A worker whose sweep process died (SIGKILL) interrupts itself instead of running on alone."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(spec: _WorkerSpec) -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # the parent stops workers with SIGTERM: interrupt, as Ctrl-C does
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(spec.threads)
    try:
        work(spec.open_ledger(worker=spec.index), spec.run, objective=spec.objective, sweep_dir=spec.sweep_dir,
             checkpoint_interval=spec.checkpoint_interval)
    except KeyboardInterrupt:
        sys.exit(130)


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
    """N worker processes; `poll()` says which are still running and reports those that died."""

    def __init__(self, count: int, open_ledger: Callable[[], Any], run: Callable[..., Any], *, objective: Objective,
                 sweep_dir: Path, checkpoint_interval: int | None):
        self.threads = max(1, min(torch.get_num_threads(), cores_available() // count))
        self.gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        spec = _WorkerSpec(open_ledger, run, objective, sweep_dir, checkpoint_interval, self.threads)
        context = multiprocessing.get_context("spawn")
        self.procs = []
        for i in range(count):
            process = context.Process(target=_worker_main, args=(dataclasses.replace(spec, index=i),),
                                      name=f"exogym-sweep-worker-{i}")
            gpu = str(i % self.gpus) if self.gpus else None
            with _environ(OMP_NUM_THREADS=str(self.threads), CUDA_VISIBLE_DEVICES=gpu):
                process.start()
            self.procs.append(process)
        self._reported: set[int] = set()

    def describe(self) -> str:
        gpus = f", GPU i mod {self.gpus} each" if self.gpus else ""
        return f"{len(self.procs)} worker processes x {self.threads} thread{'s' * (self.threads > 1)}{gpus}"

    def poll(self) -> tuple[bool, list[str]]:
        """(whether any worker still runs, a line for each worker that died since the last poll)."""
        died = []
        for i, p in enumerate(self.procs):
            if p.exitcode not in (None, 0) and i not in self._reported:
                self._reported.add(i)
                how = f"signal {signal.Signals(-p.exitcode).name}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                died.append(f"worker {i} (pid {p.pid}) ended with {how}")
        return any(p.is_alive() for p in self.procs), died

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
