"""The sweep's loss-vs-bytes view: a two-objective Optuna study beside the sweep's own, read by any Optuna tool.

The sweep's study keeps one objective (its samplers optimise what the user asked for: a TPE search is not turned
into a two-objective one). Beside it, in the same storage, the study `<study name>.pareto` has two directions, the
objective's and "minimize", and one COMPLETE trial per completed configuration, whose values are the configuration's
objective and payload bytes a node sent (each the mean over its seeds, as the table has them), with its parameters,
and the wire bytes, simulated time and reason (infeasible) as user attributes. So `study.best_trials` of it is the
loss-vs-bytes frontier (`SweepResult.frontier()`), and optuna-dashboard draws it as its Pareto front.

- The worker that completes a configuration adds its trial before it tells Optuna the configuration's value: by the
  time a configuration is COMPLETE in the sweep's study, it is in the view. On one machine the adds are taken one at
  a time (a lock file in the sweep folder), and a configuration already there is not added again (a retry, or a
  search proposing a point twice); two machines completing the same configuration at the same moment may both add
  it (same values: the front is the same).
- A study made before the view existed gets it on resume (or from `exogym sweep dashboard`): the process that
  creates the view (Optuna lets one create a study of a name) adds every configuration already COMPLETE. It reads
  the sweep's trials before the view's, so a configuration a worker completes meanwhile is seen once.
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from exogym.sweep.runs import RunLock, RunOutcome

__all__ = ["ParetoView", "pareto_name", "BYTES"]

BYTES = "payload_bytes_per_node"  # the view's second objective: what result.frontier() puts on its x axis
_ATTRS = ("wire_bytes_per_node", "sim_time_s")


def pareto_name(study_name: str) -> str:
    """The name of the sweep study's loss-vs-bytes view."""
    return f"{study_name}.pareto"


def values_of(outcomes: Iterable[RunOutcome]) -> tuple[float, float, dict[str, float]] | None:
    """(the objective's mean, the payload bytes' mean, other means) over the completed seeds, as the table has them
    (statistics.fmean); None when a seed lacks the bytes or none completed."""
    done = [o for o in outcomes if o.status == "completed"]
    if not done or any(BYTES not in o.metrics for o in done):
        return None
    attrs = {n: statistics.fmean(o.metrics[n] for o in done) for n in _ATTRS if all(n in o.metrics for o in done)}
    return (statistics.fmean(o.metrics["objective"] for o in done), statistics.fmean(o.metrics[BYTES] for o in done),
            attrs)


class ParetoView:
    """The loss-vs-bytes study of one sweep (see the module's docstring).

    Args:
        optuna: The optuna module.
        storage: The sweep study's storage.
        study_name: The sweep study's name.
        direction: The objective's direction.
        metric: The objective's name, shown by the dashboard.
        patient: patient(call, what): the call retried while the storage is away.
        lock_dir: The sweep folder, where this machine's lock file for adds lives.
    """

    def __init__(self, optuna: Any, storage: Any, study_name: str, *, direction: str, metric: str,
                 patient: Callable[[Callable[[], Any], str], Any], lock_dir: Path):
        self.optuna, self.storage, self.source_name = optuna, storage, study_name
        self.name, self.directions, self.metric = pareto_name(study_name), [direction, "minimize"], metric
        self.patient, self.lock_dir = patient, lock_dir
        self._study: Any = None

    def study(self, source: Any) -> Any:
        """The view (created, and filled from `source`, the sweep's optuna Study, when it is not there yet)."""
        if self._study is None:
            self._study = self.patient(lambda: self._open(source), "the loss-vs-bytes study")
        return self._study

    def _open(self, source: Any) -> Any:
        try:  # loaded first: a journal records every try to create a study, even one refused
            return self.optuna.load_study(storage=self.storage, study_name=self.name)
        except KeyError:
            pass
        try:
            study = self.optuna.create_study(storage=self.storage, study_name=self.name, directions=self.directions)
        except self.optuna.exceptions.DuplicatedStudyError:
            return self.optuna.load_study(storage=self.storage, study_name=self.name)
        with warnings.catch_warnings():  # Optuna calls it experimental
            warnings.simplefilter("ignore")
            study.set_metric_names([self.metric, BYTES])
        study.set_user_attr("exogym_pareto_of", self.source_name)
        complete = source.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.COMPLETE,))  # first: see above
        with self._locked():
            there = self._keys(study)
            for t in complete:
                outcomes = [RunOutcome.from_json(v) for k, v in t.user_attrs.items() if k.startswith("run:")]
                self._add(study, t.number, t.user_attrs, t.params, t.distributions, outcomes, there)
        return study

    def add(self, source: Any, number: int, user_attrs: dict[str, Any], params: dict[str, Any],
            distributions: dict[str, Any], outcomes: list[RunOutcome]) -> None:
        """Add the completed configuration of the sweep's trial `number` (its attributes, parameters, distributions
        and seeds' outcomes), unless the view has it."""
        study = self.study(source)

        def add() -> None:
            with self._locked():
                self._add(study, number, user_attrs, params, distributions, outcomes, self._keys(study))

        self.patient(add, "the loss-vs-bytes study")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = RunLock(self.lock_dir, ".pareto")  # one machine's adds, one at a time
        lock.acquire(wait=True)
        try:
            yield
        finally:
            lock.release()

    @staticmethod
    def _keys(study: Any) -> set[str]:
        return {t.user_attrs.get("key") for t in study.get_trials(deepcopy=False)}

    def _add(self, study: Any, number: int, user_attrs: dict[str, Any], params: dict[str, Any],
             distributions: dict[str, Any], outcomes: list[RunOutcome], there: set[str]) -> None:
        key = user_attrs.get("key")
        got = values_of(outcomes)
        if key is None or key in there or got is None:
            return
        objective, sent, means = got
        seeds = sum(o.status == "completed" for o in outcomes)
        attrs = {"key": key, "config": user_attrs.get("config"), "trial": number, "seeds": seeds, **means}
        if user_attrs.get("reason"):
            attrs["reason"] = user_attrs["reason"]
        study.add_trial(self.optuna.trial.create_trial(values=[objective, sent], params=params,
                                                       distributions=distributions, user_attrs=attrs))
        there.add(key)
