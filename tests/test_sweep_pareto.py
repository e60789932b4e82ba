"""The loss-vs-bytes view (exogym.sweep.pareto): a two-objective Optuna study beside the sweep's, whose Pareto front
as Optuna computes it (study.best_trials) is the sweep's own frontier, for a grid and a search; a sweep whose study
was made before the view (one objective, no view) resumes as it was and gets the view, nothing run again; and a
grid queued whole up front by an older exogym resumes with each configuration once."""

from __future__ import annotations

import pytest

from exogym.sweep import Float, Int, grid, load, space, sweep
from exogym.sweep.space import config_key
import sweep_runs
from exogym.sweep.grid_queue import GridQueue
from sweep_runs import stops_after_three, tradeoff

optuna = pytest.importorskip("optuna")


def _view(folder):
    result = load(folder)
    return result, optuna.load_study(study_name="exogym-sweep.pareto", storage=result.study.storage)


def _same_front(folder) -> int:
    result, view = _view(folder)
    rows = [r for r in result.table() if r["status"] == "completed"]
    assert view.directions == [optuna.study.StudyDirection.MINIMIZE] * 2
    assert len(view.trials) == len(rows)  # one trial per completed configuration
    by_key = {config_key({p: r[p] for p in result.params if r[p] is not None}): r for r in rows}
    for t in view.trials:  # the table's means, to the bit
        row = by_key[t.user_attrs["key"]]
        assert t.values == [row["objective"], row["payload_bytes_per_node"]]
        assert t.params == {p: row[p] for p in result.params if row[p] is not None}
    front = {t.user_attrs["key"] for t in view.best_trials}
    assert front == {config_key({p: r[p] for p in result.params if r[p] is not None}) for r in result.frontier()}
    return len(front)


def test_the_views_pareto_front_is_the_sweeps_frontier(tmp_path):
    sweep(tradeoff, grid(H=[1, 2, 5], outer_lr=[0.3, 0.5]), out=tmp_path / "g", objective="held_out",
          extra_metrics=["held_out"], progress=False)
    assert _same_front(tmp_path / "g") == 3
    sweep(tradeoff, space(H=Int(1, 8), outer_lr=Float(0.3, 0.9)), search="random", trials=6, out=tmp_path / "r",
          objective="held_out", extra_metrics=["held_out"], progress=False)
    assert _same_front(tmp_path / "r") >= 1


def test_a_study_made_before_the_view_resumes_and_gets_it(tmp_path):
    sweep(tradeoff, grid(H=[1, 2, 5], outer_lr=[0.3, 0.5]), out=tmp_path / "s", objective="held_out",
          extra_metrics=["held_out"], progress=False)
    result, _ = _view(tmp_path / "s")
    before = result.table()
    optuna.delete_study(study_name="exogym-sweep.pareto", storage=result.study.storage)  # as an older exogym left it
    assert load(tmp_path / "s").table() == before  # reading it needs no view
    resumed = sweep(tradeoff, grid(H=[1, 2, 5], outer_lr=[0.3, 0.5]), out=tmp_path / "s", objective="held_out",
                    extra_metrics=["held_out"], resume=True, progress=False)
    assert resumed.table() == before  # nothing run again (attempts 1 each), the study still one objective
    assert resumed.study.study.directions == [optuna.study.StudyDirection.MINIMIZE]
    assert _same_front(tmp_path / "s") == 3


def test_a_grid_queued_whole_by_an_older_exogym_resumes_each_configuration_once(tmp_path, monkeypatch):
    def queued_whole(self):  # what exogym did before grid_queue: every configuration queued up front, no range
        for cell, config in enumerate(self.space.configurations()):
            self._enqueue(cell, config)
        self.study.set_user_attr("exogym_queued", self.cells)
        return self.cells

    monkeypatch.setattr(GridQueue, "start", queued_whole)
    sweep_runs.CALLS.clear()
    with pytest.raises(KeyboardInterrupt):
        sweep(stops_after_three, grid(H=[2, 3], steps=[1, 2, 3]), out=tmp_path / "s", progress=False)
    monkeypatch.undo()
    sweep_runs.CALLS.clear()  # three runs left: the one interrupted and two never started
    rows = sweep(stops_after_three, grid(H=[2, 3], steps=[1, 2, 3]), out=tmp_path / "s", resume=True,
                 progress=False).table()
    assert [r["status"] for r in rows] == ["completed"] * 6 and [r["attempts"] for r in rows] == [1, 1, 1, 2, 1, 1]
    trials = load(tmp_path / "s").study.study.get_trials(deepcopy=False)
    done = sorted(t.user_attrs["key"] for t in trials if t.state == optuna.trial.TrialState.COMPLETE)
    assert len(done) == len(set(done)) == 6
