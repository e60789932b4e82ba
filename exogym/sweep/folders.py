"""A grid sweep's bookkeeping without Optuna: the run folders themselves.

Each (configuration, seed) run is a job of its own. Its outcome is `<sweep>/runs/<run name>/sweep_run.json`,
written when the run ends; its lock (runs.RunLock, an flock the kernel drops when the holder dies) says that a
worker runs it now. So a run with an outcome is done, a run whose lock is held is running, and any other run
(never started, or interrupted: killed, Ctrl-C) is free, and continues from its checkpoint when it has one.
Resuming with retry_failed moves failed and diverged outcomes aside (sweep_run.<n>.json), which frees those runs.
"""

from __future__ import annotations

from pathlib import Path

from exogym.sweep.runs import RUNS, RunLock, RunOutcome, config_status, read_outcome, write_outcome
from exogym.sweep.space import Space, run_name
from exogym.sweep.study import Entry, Job

__all__ = ["FolderLedger"]


class FolderLedger:
    """The grid of `space`, kept in the run folders under `sweep_dir` (see the module's docstring)."""

    def __init__(self, sweep_dir: Path, space: Space):
        self.sweep_dir, self.space = sweep_dir, space
        self.configs = space.configurations()

    def _folder(self, config: dict, seed: int) -> Path:
        return self.sweep_dir / RUNS / run_name(config, seed)

    def next_job(self) -> Job | None:
        for config in self.configs:
            for seed in self.space.seeds:
                if read_outcome(self._folder(config, seed)) is not None:
                    continue
                lock = RunLock(self.sweep_dir, run_name(config, seed))
                if not lock.acquire(wait=False):
                    continue  # another worker runs it
                if read_outcome(self._folder(config, seed)) is not None:
                    lock.release()  # finished between the look and the lock
                    continue
                return Job(dict(config), (seed,), held=lock)
        return None

    def done_runs(self, job: Job) -> dict[int, RunOutcome]:
        return {}  # next_job hands out only runs without an outcome

    def record_run(self, job: Job, outcome: RunOutcome) -> None:
        write_outcome(self._folder(job.config, outcome.seed), outcome)

    def finish(self, job: Job, outcomes: list[RunOutcome]) -> None:
        job.held.release()

    def interrupt(self, job: Job) -> None:
        job.held.release()  # no outcome written: the run is free again, and resumes from its checkpoint

    def mark_dead(self) -> int:
        return 0  # a dead worker's locks are gone with it

    def requeue(self, retry_failed: bool) -> int:
        if not retry_failed:
            return 0
        count = 0
        for config in self.configs:
            for seed in self.space.seeds:
                folder = self._folder(config, seed)
                outcome = read_outcome(folder)
                if outcome is not None and outcome.status in ("failed", "diverged"):
                    n = 1
                    while (folder / f"sweep_run.{n}.json").exists():
                        n += 1
                    (folder / "sweep_run.json").rename(folder / f"sweep_run.{n}.json")  # kept, not deleted
                    count += 1
        return count

    def entries(self) -> list[Entry]:
        out = []
        for config in self.configs:
            runs = {s: o for s in self.space.seeds if (o := read_outcome(self._folder(config, s))) is not None}
            status = config_status(list(runs.values()), self.space.seeds)
            if status == "interrupted":  # not every seed has an outcome
                if any(RunLock(self.sweep_dir, run_name(config, s)).held_elsewhere() for s in self.space.seeds):
                    status = "running"
                elif not runs and not any(self._folder(config, s).exists() for s in self.space.seeds):
                    status = "waiting"
            out.append(Entry(dict(config), status, runs))
        return out

    def total(self) -> int:
        return len(self.configs)
