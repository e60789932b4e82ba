"""A grid is queued as workers drain the queue (exogym.sweep.grid_queue): a grid of a million cells starts at once
and holds only its queue, every configuration runs once with several workers and a union of grids sharing
configurations, and a first trial queued twice (a machine resuming while the maker still sets up) runs once."""

from __future__ import annotations

import json
import tracemalloc

import pytest

import sweep_runs
from exogym.sweep import grid, load, sweep
from exogym.sweep import grid_queue
from exogym.sweep.grid_queue import GridQueue
from sweep_runs import stops_after_three, tiny

optuna = pytest.importorskip("optuna")
STATE = pytest.importorskip("optuna").trial.TrialState


def _trials(folder):
    return load(folder).study.study.get_trials(deepcopy=False)


def _peak_of_three_runs(space, out) -> int:
    sweep_runs.CALLS.clear()
    tracemalloc.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            sweep(stops_after_three, space, out=out, progress=False)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_million_cell_grid_starts_at_once_and_holds_only_its_queue(tmp_path):
    def cube(n):
        return grid(H=list(range(1, n + 1)), outer_lr=[i / n for i in range(1, n + 1)], steps=list(range(1, n + 1)))

    assert cube(100).count() == 1_000_000
    _peak_of_three_runs(cube(10), tmp_path / "warm")  # what a first sweep imports is not counted below
    small = _peak_of_three_runs(cube(10), tmp_path / "small")
    big = _peak_of_three_runs(cube(100), tmp_path / "big")
    assert [c["steps"] for c in sweep_runs.CALLS[:3]] == [1, 2, 3]  # the grid's first cells, in order
    trials = _trials(tmp_path / "big")
    assert len(trials) <= 1 + 2 * grid_queue.CHUNK  # the queue, not the grid: at most two ranges ahead
    assert sorted(t.user_attrs["cell"] for t in trials) == list(range(len(trials)))  # each cell once, in order
    assert big < 2 * small  # memory does not grow with the grid (1,000 cells against 1,000,000)
    rows = load(tmp_path / "big").table()
    assert [r["status"] for r in rows[:4]] == ["completed"] * 3 + ["interrupted"]


@pytest.mark.spawns
def test_every_configuration_runs_once_with_two_workers_and_small_ranges(tmp_path, monkeypatch):
    monkeypatch.setattr(grid_queue, "CHUNK", 2)  # kept on the study: the worker processes queue ranges of 2
    space = grid(H=[1, 2, 3, 4], outer_lr=[0.3, 0.7]) + grid(H=[2, 3, 5], outer_lr=[0.7])  # shares 2 of its 3
    result = sweep(tiny, space, out=tmp_path / "s", workers=2, progress=False)
    done = [t for t in _trials(tmp_path / "s") if t.state == STATE.COMPLETE]
    keys = [t.user_attrs["key"] for t in done]
    assert sorted(keys) == sorted(json.dumps(c, sort_keys=True) for c in space.configurations())  # each once
    assert len(keys) == space.count() == 9
    assert all(t in done or t.user_attrs.get("reason") == "no configuration left" for t in _trials(tmp_path / "s"))
    assert [r["status"] for r in result.table()] == ["completed"] * 9


def test_a_first_trial_queued_twice_runs_once(tmp_path, monkeypatch):
    # The interleaving: the maker and a machine resuming the sweep while the maker still sets it up each find no
    # first trial, and each queues one. The later one is pruned when taken; each configuration runs once.
    refill = GridQueue._refill

    def twice(self, start, end, *, check, first=False):
        refill(self, start, end, check=check, first=first)
        if first:
            refill(self, start, end, check=False, first=True)  # the other machine's, which saw none

    monkeypatch.setattr(GridQueue, "_refill", twice)
    rows = sweep(tiny, grid(H=[2, 3, 4]), out=tmp_path / "s", progress=False).table()
    assert [(r["H"], r["status"], r["attempts"]) for r in rows] == [(2, "completed", 1), (3, "completed", 1),
                                                                    (4, "completed", 1)]
    trials = _trials(tmp_path / "s")
    assert sorted(t.params["H"] for t in trials if t.state == STATE.COMPLETE) == [2, 3, 4]
    assert [t.user_attrs["reason"] for t in trials if t.state == STATE.PRUNED] == ["queued twice"]
    monkeypatch.setattr(GridQueue, "_twin", lambda self, frozen: False)  # without the rule: the grid runs twice
    sweep(tiny, grid(H=[2, 3, 4]), out=tmp_path / "t", progress=False)
    assert sorted(t.params["H"] for t in _trials(tmp_path / "t") if t.state == STATE.COMPLETE) == [2, 2, 3, 3, 4, 4]
