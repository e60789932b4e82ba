"""The sweep's bookkeeping in an Optuna study: which configurations exist, which ran, how they ended.

One Optuna trial is one configuration (all its seeds); its value is the objective's mean over the seeds, and
its user attributes hold each seed's outcome ("run:<seed>"), the configuration's key, the worker that ran it
(host, pid) and how it ended ("status": completed, diverged, failed, interrupted). The study lives in
Optuna's storage: SQLite in the sweep folder by default, or any SQL URL Optuna takes (several machines).

- A grid is written into the study when the sweep is created, one WAITING trial per configuration; workers
  take them one at a time. A search asks Optuna's sampler (random, or TPE with Optuna's constraints) for a new
  trial while the budget of trials lasts.
- Taking a WAITING trial sets it RUNNING only if it is still WAITING, in one transaction. SQLite cannot lock a
  row, so its transactions here start with BEGIN IMMEDIATE: one writer at a time, and two workers never take
  the same trial.
- A trial whose worker died (its pid gone on this host, or, from another machine, no Optuna heartbeat for
  GRACE_S) is marked interrupted. Resuming queues an interrupted trial again (and a failed or diverged one when
  asked); seeds that completed in an earlier attempt are not run again.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

from exogym.sweep.objective import Objective
from exogym.sweep.runs import RunOutcome, config_status
from exogym.sweep.space import Choice, Float, Int, Space, Value, config_key

__all__ = ["StudyLedger", "Job", "Entry", "import_optuna", "INSTALL"]

INSTALL = "pip install 'exogym[sweep]'"
HEARTBEAT_S, GRACE_S = 30, 120


def import_optuna(why: str) -> Any:
    try:
        import optuna
    except ImportError as e:
        raise ImportError(f"{why} needs Optuna: {INSTALL} (grid sweeps run without it)") from e
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@dataclass
class Job:
    """A configuration a worker runs: its values, key and seeds (number: the Optuna trial, or -1)."""

    config: dict[str, Value]
    seeds: tuple[int, ...]
    number: int = -1
    trial_id: int = -1
    held: Any = None  # the folder ledger's lock, held while the job runs

    @property
    def key(self) -> str:
        return config_key(self.config)


@dataclass
class Entry:
    """What the table shows of one configuration: its latest attempt and every seed's outcome."""

    config: dict[str, Value]
    status: str  # completed, diverged, failed, interrupted, running, waiting
    runs: dict[int, RunOutcome] = field(default_factory=dict)
    attempts: int = 1
    number: int = -1


def _alive(host: str, pid: int) -> bool | None:
    """Whether a worker on this host still runs (None: another host, cannot tell from here)."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _storage(optuna: Any, url: str) -> Any:
    sqlite = url.startswith("sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 300}} if sqlite else None,
                                             heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    if sqlite:  # SQLite has no SELECT ... FOR UPDATE: make every transaction take the write lock when it begins
        from sqlalchemy import event

        @event.listens_for(storage.engine, "connect")
        def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None
            # Write-ahead log, synced at checkpoints: a commit costs no fsync of its own (13 per trial), and a
            # killed process loses nothing it committed. (SQLite on a network file system: use a server URL.)
            dbapi_connection.execute("PRAGMA journal_mode=WAL")
            dbapi_connection.execute("PRAGMA synchronous=NORMAL")

        @event.listens_for(storage.engine, "begin")
        def _begin_immediate(connection: Any) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")

        storage.engine.dispose()  # connections opened before the listeners go
    return storage


class StudyLedger:
    """The Optuna study of one sweep (see the module's docstring)."""

    def __init__(self, url: str, study_name: str, space: Space, objective: Objective, *, search: str,
                 trials: int | None, sampler_seed: int = 0, create: bool = False):
        optuna = import_optuna(f"search={search!r}" if search != "grid" else "a sweep kept in an Optuna study")
        self.optuna, self.space, self.objective, self.search, self.trials = optuna, space, objective, search, trials
        self.storage = _storage(optuna, url)
        if search == "tpe":
            sampler = optuna.samplers.TPESampler(seed=sampler_seed)  # reads the constraints finish() sets
        else:
            sampler = optuna.samplers.RandomSampler(seed=sampler_seed)
        direction = objective.direction
        if create:
            self.study = optuna.create_study(storage=self.storage, study_name=study_name, direction=direction,
                                             sampler=sampler)
            if search == "grid":
                self._write_grid()
        else:
            self.study = optuna.load_study(storage=self.storage, study_name=study_name, sampler=sampler)
        self.study_id = self.storage.get_study_id_from_name(study_name)
        self._beat: tuple[threading.Event, threading.Thread] | None = None

    # -- the configurations ------------------------------------------------------------------------------
    def _distributions(self, names: list[str]) -> dict[str, Any]:
        return {n: self.optuna.distributions.CategoricalDistribution(self.space.choices(n)) for n in names}

    def _write_grid(self) -> None:
        waiting = self.optuna.trial.TrialState.WAITING
        self.study.add_trials([
            self.optuna.trial.create_trial(state=waiting, params=c, distributions=self._distributions(list(c)),
                                           user_attrs={"key": config_key(c)})
            for c in self.space.configurations()])

    def _suggest(self, trial: Any) -> dict[str, Value]:
        branch = self.space.branch()
        part = self.space.parts[0]
        config: dict[str, Value] = {}
        if branch is not None:
            config[branch] = trial.suggest_categorical(branch, self.space.choices(branch))
            part = next(p for p in self.space.parts if p[branch].values[0] == config[branch])
        for name, dim in part.items():
            if name == branch:
                continue
            if isinstance(dim, Choice):
                config[name] = trial.suggest_categorical(name, dim.values)
            elif isinstance(dim, Int):
                config[name] = trial.suggest_int(name, dim.low, dim.high, log=dim.log)
            elif isinstance(dim, Float):
                config[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
        return config

    def _asked(self) -> int:
        """Trials that count against the budget: all but the re-runs of interrupted or failed ones."""
        return sum(1 for t in self.study.get_trials(deepcopy=False) if "retry_of" not in t.user_attrs)

    def _pop_waiting(self) -> int | None:
        running = self.optuna.trial.TrialState.RUNNING
        for t in self.storage.get_all_trials(self.study_id, deepcopy=False,
                                             states=(self.optuna.trial.TrialState.WAITING,)):
            try:
                if self.storage.set_trial_state_values(t._trial_id, state=running):
                    return t._trial_id  # this transaction saw it WAITING and made it RUNNING: it is ours
            except self.optuna.exceptions.UpdateFinishedTrialError:
                continue
        return None

    def next_job(self) -> Job | None:
        trial_id = self._pop_waiting()
        if trial_id is not None:
            frozen = self.storage.get_trial(trial_id)
            config = dict(frozen.params)
        elif self.search != "grid" and self._asked() < self.trials:
            with warnings.catch_warnings():  # Optuna notes that its heartbeat is meant for optimize(): ours beats
                warnings.simplefilter("ignore", UserWarning)
                trial = self.study.ask()
            trial_id, config = trial._trial_id, self._suggest(trial)
            frozen = self.storage.get_trial(trial_id)
        else:
            return None
        config = self.space.ordered(config)  # Optuna may keep the values in another order
        self.storage.set_trial_user_attr(trial_id, "key", config_key(config))
        self.storage.set_trial_user_attr(trial_id, "worker", {"host": socket.gethostname(), "pid": os.getpid()})
        self._start_heartbeat(trial_id)
        return Job(config, self.space.seeds, frozen.number, trial_id)

    # -- while and after a configuration runs ----------------------------------------------------------------
    def _start_heartbeat(self, trial_id: int) -> None:
        self._stop_heartbeat()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # the next beat tries again; a missed one only makes the trial look older
                    pass
        self.storage.record_heartbeat(trial_id)
        thread = threading.Thread(target=beat, name=f"exogym-sweep-heartbeat-{trial_id}", daemon=True)
        thread.start()
        self._beat = (stop, thread)

    def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat[0].set()
            self._beat[1].join()
            self._beat = None

    def done_runs(self, job: Job) -> dict[int, RunOutcome]:
        """Seeds of this configuration that completed (or diverged) in any attempt: never run again."""
        done: dict[int, RunOutcome] = {}
        for t in self.study.get_trials(deepcopy=False):
            if t.user_attrs.get("key") != job.key:
                continue
            for seed in job.seeds:
                data = t.user_attrs.get(f"run:{seed}")
                if data and data["status"] in ("completed", "diverged"):
                    done[seed] = RunOutcome.from_json(data)
        return done

    def record_run(self, job: Job, outcome: RunOutcome) -> None:
        self.storage.set_trial_user_attr(job.trial_id, f"run:{outcome.seed}", outcome.to_json())

    def finish(self, job: Job, outcomes: list[RunOutcome]) -> None:
        self._stop_heartbeat()
        status = config_status(outcomes, job.seeds)
        self.storage.set_trial_user_attr(job.trial_id, "status", status)
        if status == "completed":
            values = [o.metrics["objective"] for o in outcomes]
            violation = max(o.metrics["violation"] for o in outcomes)
            self.storage.set_trial_user_attr(job.trial_id, "violation", violation)
            if self.objective.max_bytes is not None or self.objective.max_sim_time is not None:
                # Optuna's constraints (<= 0: feasible), which its TPE sampler takes into account.
                self.optuna.trial.Trial(self.study, job.trial_id).set_constraint("violation", violation)
            self.study.tell(job.number, sum(values) / len(values))
        else:
            self.study.tell(job.number, state=self.optuna.trial.TrialState.FAIL)

    def interrupt(self, job: Job) -> None:
        self._stop_heartbeat()
        self._mark_interrupted(job.trial_id)

    def _mark_interrupted(self, trial_id: int) -> None:
        try:
            self.storage.set_trial_user_attr(trial_id, "status", "interrupted")
            self.storage.set_trial_state_values(trial_id, state=self.optuna.trial.TrialState.FAIL)
        except self.optuna.exceptions.UpdateFinishedTrialError:
            pass  # another process marked it first

    # -- resuming ------------------------------------------------------------------------------------------
    def mark_dead(self) -> int:
        """RUNNING trials whose worker is gone (on this host: its pid; elsewhere: no heartbeat): interrupted."""
        found = 0
        for t in self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,)):
            worker = t.user_attrs.get("worker")
            if worker and _alive(worker["host"], worker["pid"]) is False:
                self._mark_interrupted(t._trial_id)
                found += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.optuna.storages.fail_stale_trials(self.study)  # another machine's worker: by Optuna's heartbeat
        return found

    def requeue(self, retry_failed: bool) -> int:
        """Queue again every interrupted trial (and failed/diverged ones when retry_failed) not yet re-queued."""
        trials = self.study.get_trials(deepcopy=False)
        queued = {t.user_attrs.get("retry_of") for t in trials}
        again = ("interrupted", "failed", "diverged") if retry_failed else ("interrupted",)
        latest: dict[str, Any] = {}
        for t in trials:  # only a configuration's latest attempt decides
            latest[t.user_attrs.get("key", str(t.number))] = t
        count = 0
        for t in latest.values():
            if t.state != self.optuna.trial.TrialState.FAIL or t.number in queued:
                continue
            if t.user_attrs.get("status", "interrupted") in again:  # no status: failed by Optuna's heartbeat
                self.study.add_trial(self.optuna.trial.create_trial(
                    state=self.optuna.trial.TrialState.WAITING, params=t.params, distributions=t.distributions,
                    user_attrs={"key": t.user_attrs.get("key"), "retry_of": t.number}))
                count += 1
        return count

    # -- what the table shows ------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        state = self.optuna.trial.TrialState
        by_key: dict[str, Entry] = {}
        for t in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number):
            key = t.user_attrs.get("key")
            if key is None:
                continue  # asked but never given its configuration (a worker stopped in between)
            status = {state.COMPLETE: "completed", state.RUNNING: "running", state.WAITING: "waiting"}.get(
                t.state, t.user_attrs.get("status", "interrupted"))
            entry = by_key.get(key)
            if entry is None:
                entry = by_key[key] = Entry(dict(t.params) or json.loads(key), status, number=t.number, attempts=0)
            entry.attempts += 1
            if not (entry.status == "completed" and status != "completed"):
                entry.status, entry.number = status, t.number
            for name, data in t.user_attrs.items():
                if name.startswith("run:"):
                    entry.runs[int(name[4:])] = RunOutcome.from_json(data)
        return list(by_key.values())  # the grid's order (a search: the order its trials were asked)

    def total(self) -> int:
        return len(self.space.configurations()) if self.search == "grid" else int(self.trials or 0)

