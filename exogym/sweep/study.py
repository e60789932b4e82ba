"""The sweep's bookkeeping: an Optuna study, run through Optuna's own API.

- One trial is one configuration (all its seeds). A worker runs trials with `study.optimize(n_trials=1)`:
  Optuna claims a waiting trial (or asks its sampler for a new one), beats its heartbeat where the storage has
  one, fails stale trials first, and tells the result. Each seed's outcome is kept on the trial (user attribute
  `run:<seed>`) as it finishes, and in its run folder (`sweep_run.json`) before that, so a result the
  storage could not take (an outage) reaches the study later and is never run again.
- A grid is queued with `study.enqueue_trial` as workers drain the queue (grid_queue.GridQueue: each configuration
  once, its values fixed); a search asks the sampler (random or TPE) for up to `trials` configurations.
- States are Optuna's; the user attribute `reason` says why a trial is not plainly COMPLETE: FAIL with reason
  `failed`, `diverged` or `interrupted`; COMPLETE with reason `infeasible` (over a constraint, which the TPE
  sampler is told through Optuna's constraints); PRUNED with reason `over budget` (a search's trial asked past
  its budget by a worker racing another), `no configuration left` (a grid's worker asking as the last one
  was taken: Optuna's ask makes a new trial when the queue is empty) or `queued twice` (see grid_queue). Any Optuna
  tool reads the study as it is.
- Each completed configuration is also added to the loss-vs-bytes view (pareto.ParetoView), before its value is
  told.
- Retries are Optuna's `RetryHeartbeatStaleTrialCallback`: a trial failed as stale (its heartbeat stopped), or
  whose worker process died, or (on resume) one interrupted (or failed, with retry_failed) is queued again as a
  new trial with the same values; the new trial carries the seeds already done.
"""

from __future__ import annotations

import datetime
import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from exogym.sweep.grid_queue import QUEUED_TWICE, GridQueue
from exogym.sweep.pareto import ParetoView
from exogym.sweep.runs import RunOutcome, config_status, read_outcome
from exogym.sweep.space import Choice, Float, Int, Value, config_key, run_name
from exogym.sweep.storage import import_optuna, open_storage, patient

# A worker marks a trial it took (its "worker" attribute) within milliseconds; a RUNNING trial unmarked for this
# long was taken just as the storage went away, and will never run (see SweepStudy._requeue_orphans).
ORPHAN_AFTER_S = 5.0

# A grid whose queue is empty but not all queued waits for the range being queued; with nothing running or waiting
# for this long, it ends (a resume continues the grid).
GRID_IDLE_S = 5.0

# A worker with nothing to take while other workers' trials run (a storage with a heartbeat) looks again this often
# (or every heartbeat, if shorter): it ends, or takes a trial failed as stale, within a second of the change.
IDLE_POLL_S = 1.0

__all__ = ["SweepStudy", "Entry", "REASONS"]

REASONS = ("failed", "diverged", "interrupted", "infeasible", "over budget", "no configuration left", QUEUED_TWICE)


@dataclass
class Entry:
    """What the table shows of one configuration: its latest attempt and every seed's outcome."""

    config: dict[str, Value]
    status: str  # completed, diverged, failed, interrupted, running, waiting
    runs: dict[int, RunOutcome] = field(default_factory=dict)
    attempts: int = 1
    number: int = -1


def _retry_callback(optuna: Any, max_retry: int | None) -> Any:
    with warnings.catch_warnings():  # Optuna calls it experimental
        warnings.simplefilter("ignore")
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)


class _NotCompleted(Exception):
    """Raised by a trial whose configuration failed or diverged: Optuna records it as FAIL."""


class SweepStudy:
    """The Optuna study of one sweep (see the module's docstring). `definition` is the sweep's Definition."""

    def __init__(self, definition: Any, *, create: bool = False, worker: int = 0, worker_id: str = ""):
        optuna = import_optuna("a sweep")
        self.optuna, self.definition = optuna, definition
        self.space, self.objective = definition.space, definition.objective
        self.search, self.trials = definition.search, definition.trials
        self.url, self.patience, self.worker_id = definition.url, definition.storage_patience, worker_id
        self.storage = open_storage(definition.storage, folder=definition.path, heartbeat=definition.heartbeat,
                                    grace=definition.grace, max_retry=definition.max_retry,
                                    patience=definition.storage_patience)
        self.beats = definition.storage != "default" and not definition.storage.startswith("sqlite")
        seed = definition.sampler_seed + worker
        sampler = optuna.samplers.TPESampler(seed=seed) if self.search == "tpe" else \
            optuna.samplers.RandomSampler(seed=seed)
        name = definition.study_name
        self.created = False
        if create:
            try:  # one maker: the database refuses a second study of this name, and that process joins it
                self.study = self._patient(lambda: optuna.create_study(
                    storage=self.storage, study_name=name, direction=self.objective.direction, sampler=sampler),
                    "a new study")
                self.created = True
            except optuna.exceptions.DuplicatedStudyError:
                create = False
        if not create:
            try:
                self.study = self._patient(lambda: optuna.load_study(storage=self.storage, study_name=name,
                                                                     sampler=sampler), "the study")
            except KeyError:
                raise ValueError(f"the study {name!r} is not in {definition.shown_storage}: the sweep folder "
                                 f"{definition.folder} points at a study that was never created (or was "
                                 "deleted); start the sweep again with another out=") from None
        self._told: tuple[int, float | None] | None = None
        self.study_id = self._patient(lambda: self.storage.get_study_id_from_name(name))
        self.grid = GridQueue(self.study, self.space, self._patient) if self.search == "grid" else None
        self.pareto = ParetoView(optuna, self.storage, name, direction=self.objective.direction,
                                 metric=self.objective.metric, patient=self._patient, lock_dir=definition.path)

    def _patient(self, call: Callable[[], Any], what: str = "the study") -> Any:
        return patient(call, url=self.url, patience=self.patience, what=what)

    # -- setting the study up --------------------------------------------------------------------------------
    def stored_definition(self, wait: float = 0.0) -> dict[str, Any] | None:
        """The sweep's definition kept on the study (waiting up to `wait` s for its maker to write it)."""
        deadline = time.monotonic() + wait
        while True:
            data = self._patient(lambda: self.study.user_attrs.get("exogym_sweep"))
            if data is not None or time.monotonic() >= deadline:
                return data
            time.sleep(0.2)

    def describe_as(self, data: dict[str, Any]) -> None:
        self._patient(lambda: self.study.set_user_attr("exogym_sweep", data))

    def queue_grid(self) -> int:
        """Queue the grid's first configurations (the rest are queued as workers take them: grid_queue), or continue
        a queue that stopped; the number of grid cells queued so far."""
        return self.grid.start() if self.grid is not None else 0

    def open_pareto(self) -> Any:
        """The loss-vs-bytes view of the study (created, and filled with what completed, when it is not there)."""
        return self.pareto.study(self.study)

    # -- running trials --------------------------------------------------------------------------------------
    def _trials(self, states: tuple[Any, ...] | None = None) -> list[Any]:
        return self._patient(lambda: self.study.get_trials(deepcopy=False, states=states))

    def fail_stale(self) -> None:
        """Optuna's fail_stale_trials (a storage with a heartbeat): stale trials failed and queued again."""
        if self.beats:
            with warnings.catch_warnings():  # Optuna calls it experimental
                warnings.simplefilter("ignore")
                self._patient(lambda: self.optuna.storages.fail_stale_trials(self.study))

    def has_work(self) -> bool:
        """Whether a trial is waiting or a search has budget left. While a grid's next range is being queued, wait
        for it; while other workers' trials run on a storage with a heartbeat, wait: one whose worker died is failed
        as stale and queued again."""
        state = self.optuna.trial.TrialState
        idle_since = None
        while True:
            self.fail_stale()
            self._patient(self._requeue_orphans, "the study's orphaned trials")
            if self._trials((state.WAITING,)):
                return True
            running = bool(self._trials((state.RUNNING,)))
            if self.grid is not None and self.grid.pending():
                # The worker holding the trial that carries the next range queues it now (or its retry is on its way).
                idle_since = None if running else idle_since or time.monotonic()
                if idle_since is None or time.monotonic() - idle_since < GRID_IDLE_S:
                    time.sleep(0.1)
                    continue
            elif self.grid is None and self._fresh(self._trials()) < (self.trials or 0):
                return True
            if not (self.beats and running):
                return False
            time.sleep(min(self.definition.heartbeat, IDLE_POLL_S))

    def _fresh(self, trials: list[Any], before: int | None = None) -> int:
        """Trials a search asked its sampler for (not retries, not those pruned as over budget)."""
        fail = self.optuna.trial.TrialState.FAIL
        return sum(1 for t in trials if "cell" not in t.user_attrs and "retry_history" not in t.system_attrs
                   and t.user_attrs.get("reason") != "over budget" and (before is None or t.number < before)
                   and not (t.state == fail and "worker" not in t.user_attrs))  # an orphan proposed nothing

    def run_trial(self, execute: Callable[[dict[str, Value], dict[int, RunOutcome], Callable[[RunOutcome], None]],
                                          list[RunOutcome]]) -> list[RunOutcome] | None:
        """Run one trial through study.optimize: execute(config, seeds done, record) runs the seeds not done and
        returns every seed's outcome. Returns the outcomes (None: the trial was pruned, nothing ran)."""
        self._told, result = None, {}

        def objective(trial: Any) -> float:
            config = self._config_of(trial)
            if config is None:
                raise self.optuna.TrialPruned()
            self._set(trial, "key", config_key(config))
            self._set(trial, "worker", self.worker_id)
            carries = "first" in trial.user_attrs or "refill" in trial.user_attrs  # a grid range to queue
            if carries and not self.grid.take(trial, self._frozen(trial)):
                self._set(trial, "reason", QUEUED_TWICE)
                raise self.optuna.TrialPruned()
            done = self.done_runs(trial, config)
            for seed, outcome in done.items():  # found in its run folder only (an outage): the trial holds it now
                if f"run:{seed}" not in trial.user_attrs:
                    self._set(trial, f"run:{seed}", outcome.to_json())
            try:
                outcomes = execute(config, done, lambda o: self._set(trial, f"run:{o.seed}", o.to_json()))
            except KeyboardInterrupt:
                self._set(trial, "reason", "interrupted")
                raise
            result["outcomes"] = outcomes
            return self._finish(trial, outcomes)

        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            if self._told is None:
                if tries > 1:  # the storage failed during the last try: a trial it took may be orphaned
                    self._requeue_orphans()
                self.study.optimize(objective, n_trials=1, catch=(_NotCompleted,))
                return
            number, value = self._told  # the trial ran and its outcomes are stored; only Optuna's tell is left
            try:
                if value is None:
                    self.study.tell(number, state=self.optuna.trial.TrialState.FAIL)
                else:
                    self.study.tell(number, value)
            except self.optuna.exceptions.UpdateFinishedTrialError:
                pass  # failed as stale meanwhile: its retry takes the stored outcomes, nothing is run again

        self._patient(attempt, "a trial")
        return result.get("outcomes")

    def _requeue_orphans(self) -> None:
        """Trials taken from the queue just as the storage went away, before their worker could mark them: RUNNING,
        with no worker, for longer than a worker takes to mark one (ORPHAN_AFTER_S). They never ran, and having no
        heartbeat they are never failed as stale: each is failed here and its configuration queued again, so an
        outage loses no configuration. Whichever worker fails one first queues it again (tell refuses the
        others)."""
        state = self.optuna.trial.TrialState
        older = datetime.datetime.now() - datetime.timedelta(seconds=ORPHAN_AFTER_S)
        for t in self.study.get_trials(deepcopy=False, states=(state.RUNNING,)):
            if "worker" in t.user_attrs or t.datetime_start is None or t.datetime_start > older:
                continue
            t_attrs = dict(t.user_attrs)  # a grid's or a retry's queued configuration, if any
            try:
                self.study.tell(t.number, state=state.FAIL)
            except self.optuna.exceptions.UpdateFinishedTrialError:
                continue  # another worker took it first
            if "config" in t_attrs:
                self.study.enqueue_trial(t_attrs["config"], user_attrs={**t_attrs, "requeued": True})

    def _frozen(self, trial: Any) -> Any:
        """The trial as stored (with its system attributes: whether it is a retry)."""
        return self._patient(lambda: self.storage.get_trial(
            self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)))

    def _set(self, trial: Any, name: str, value: Any) -> None:
        self._patient(lambda: trial.set_user_attr(name, value), "a run's outcome")

    def _config_of(self, trial: Any) -> dict[str, Value] | None:
        """The trial's configuration: queued (a grid, a retry) or proposed by the sampler; None when it is pruned."""
        queued = trial.user_attrs.get("config")
        if queued is not None:
            for name, value in queued.items():  # Optuna records each value with its distribution
                trial.suggest_categorical(name, self.space.choices(name))
            return self.space.ordered(queued)
        if self.search == "grid":
            self._set(trial, "reason", "no configuration left")
            return None
        if self._fresh(self._trials(), before=trial.number) >= (self.trials or 0):
            self._set(trial, "reason", "over budget")
            return None
        config = self.space.ordered(self._suggest(trial))
        self._set(trial, "config", config)
        return config

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

    def _finish(self, trial: Any, outcomes: list[RunOutcome]) -> float:
        status = config_status(outcomes, self.space.seeds)
        if status != "completed":
            self._set(trial, "reason", status)
            self._told = (trial.number, None)
            raise _NotCompleted(status)
        value = sum(o.metrics["objective"] for o in outcomes) / len(outcomes)
        violation = max(o.metrics["violation"] for o in outcomes)
        self._set(trial, "reason", "infeasible" if violation > 0 else None)
        for name in ("payload_bytes_per_node", "wire_bytes_per_node", "sim_time_s"):  # shown by Optuna's tools
            values = [o.metrics[name] for o in outcomes if name in o.metrics]
            if values:
                self._set(trial, name, sum(values) / len(values))
        if self.objective.max_bytes is not None or self.objective.max_sim_time is not None:
            self._patient(lambda: trial.set_constraint("violation", violation))  # read by the TPE sampler
        # Before the value is told: a configuration COMPLETE in the study is in the view (see pareto).
        self.pareto.add(self.study, trial.number, trial.user_attrs, trial.params, trial.distributions, outcomes)
        self._told = (trial.number, value)
        return value

    def done_runs(self, trial: Any, config: dict[str, Value]) -> dict[int, RunOutcome]:
        """Seeds of this configuration that completed (or diverged) in an earlier attempt (carried by the retry),
        or whose outcome sits in its run folder without having reached the study: never run again."""
        done: dict[int, RunOutcome] = {}
        for seed in self.space.seeds:
            data = trial.user_attrs.get(f"run:{seed}")
            outcome = RunOutcome.from_json(data) if data else \
                read_outcome(self.definition.path / "runs" / run_name(config, seed))
            if outcome is not None and outcome.status in ("completed", "diverged"):
                done[seed] = outcome
        return done

    # -- workers that stopped ----------------------------------------------------------------------------------
    def retry(self, trial: Any) -> None:
        """Queue `trial` (FAIL) again through Optuna's retry callback (its values, its seeds done)."""
        callback = _retry_callback(self.optuna, self.definition.max_retry)
        self._patient(lambda: callback(self.study, trial), "a retry")

    def interrupt_running(self, worker_id: str | None = None) -> int:
        """RUNNING trials of a worker that is gone (worker_id; None: every RUNNING trial, when no other process
        can hold one) marked FAIL with reason interrupted, and queued again."""
        count = 0
        for t in self._trials((self.optuna.trial.TrialState.RUNNING,)):
            if worker_id is not None and t.user_attrs.get("worker") != worker_id:
                continue
            self._patient(lambda: self.storage.set_trial_user_attr(t._trial_id, "reason", "interrupted"))
            try:
                self._patient(lambda: self.storage.set_trial_state_values(
                    t._trial_id, state=self.optuna.trial.TrialState.FAIL))
            except self.optuna.exceptions.UpdateFinishedTrialError:
                continue  # it ended meanwhile
            self.retry(self._patient(lambda: self.storage.get_trial(t._trial_id)))
            count += 1
        return count

    def requeue(self, retry_failed: bool) -> int:
        """Queue again every interrupted configuration (and failed or diverged ones when retry_failed) whose latest
        attempt is not queued already."""
        state = self.optuna.trial.TrialState
        trials = self._trials()
        retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
        again = ("interrupted", "failed", "diverged") if retry_failed else ("interrupted",)
        latest: dict[str, Any] = {}
        for t in trials:
            if "key" in t.user_attrs:
                latest[t.user_attrs["key"]] = t
        count = 0
        for t in latest.values():
            if t.state == state.FAIL and t.number not in retried and t.user_attrs.get("reason", "interrupted") in again:
                callback = _retry_callback(self.optuna, None)  # asked for: no retry limit
                self._patient(lambda: callback(self.study, t), "a retry")
                count += 1
        return count

    # -- what the table shows --------------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        state = self.optuna.trial.TrialState
        by_key: dict[str, Entry] = {}
        for t in sorted(self._trials(), key=lambda t: (t.user_attrs.get("cell", -1), t.number)):
            key = t.user_attrs.get("key")
            if key is None or t.user_attrs.get("reason") == QUEUED_TWICE:
                continue  # pruned before it was given a configuration, or a grid trial's twin
            status = {state.COMPLETE: "completed", state.RUNNING: "running", state.WAITING: "waiting"}.get(
                t.state, t.user_attrs.get("reason") or "interrupted")  # infeasible: the table's feasible column
            entry = by_key.get(key)
            if entry is None:
                entry = by_key[key] = Entry(dict(t.user_attrs.get("config") or json.loads(key)), status,
                                            number=t.number, attempts=0)
            entry.attempts += t.state != state.WAITING and "worker" in t.user_attrs  # an orphan never ran
            if not (entry.status == "completed" and status != "completed"):
                entry.status, entry.number = status, t.number
            for name, data in t.user_attrs.items():
                if name.startswith("run:"):
                    entry.runs[int(name[4:])] = RunOutcome.from_json(data)
        for entry in by_key.values():  # a study written before the outcomes in run folders were carried over
            if entry.status == "completed":
                for seed in self.space.seeds:
                    outcome = entry.runs.get(seed) or read_outcome(
                        self.definition.path / "runs" / run_name(self.space.ordered(entry.config), seed))
                    if outcome is not None:
                        entry.runs[seed] = outcome
        return list(by_key.values())  # the grid's order (a search: the order its trials were asked)

    def run_names(self) -> set[str]:
        """The run folders (names under `<sweep>/runs/`) the configurations a worker took account for, every seed."""
        names = set()
        for t in self._trials():
            key = t.user_attrs.get("key")
            if key is not None and "worker" in t.user_attrs:
                config = self.space.ordered(json.loads(key))
                names.update(run_name(config, seed) for seed in self.space.seeds)
        return names

    def total(self) -> int:
        return self.space.count() if self.search == "grid" else int(self.trials or 0)

