"""exogym.sweep: grids and searches on a tiny task, the table, budgets and constraints, diverged and failed
configurations, the frontier, and every bad input stopped before a trial starts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from exogym.sweep import Float, Int, grid, load, space, sweep
from exogym.sweep.objective import Objective, parse_bytes
from exogym.sweep.results import pareto
from sweep_runs import tiny

pytest.importorskip("optuna")


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_grid_runs_every_configuration_once_and_averages_the_seeds(tmp_path):
    result = sweep(tiny, grid(H=[2, 5], outer_lr=[0.5, 0.9], seed=[0, 1]), out=tmp_path / "s", progress=False)
    rows = result.table()
    assert [(r["H"], r["outer_lr"]) for r in rows] == [(2, 0.5), (2, 0.9), (5, 0.5), (5, 0.9)]
    runs = sorted(p.name for p in (tmp_path / "s" / "runs").iterdir())
    assert len(runs) == 8 and "H=2,outer_lr=0.5,seed=1" in runs  # one normal run folder per configuration and seed
    for r in rows:
        losses = [_summary(Path(d))["final_global_loss"] for d in r["run_dirs"].split(" ")]
        assert r["status"] == "completed" and r["seeds"] == 2 and r["attempts"] == 1
        assert r["objective"] == pytest.approx(statistics.fmean(losses))
        assert r["objective_std"] == pytest.approx(statistics.stdev(losses))
    assert result.best()["objective"] == min(r["objective"] for r in rows)
    for name in ("results.csv", "results.md", "frontier.png", "heatmap.png"):
        assert (tmp_path / "s" / name).exists(), name
    assert "**" in (tmp_path / "s" / "results.md").read_text()  # the best row in bold
    assert [r["objective"] for r in load(tmp_path / "s").table()] == [r["objective"] for r in rows]
    with pytest.raises(ValueError, match="holds a sweep already"):  # a sweep folder is never written over
        sweep(tiny, grid(H=[2]), out=tmp_path / "s", progress=False)


@pytest.mark.parametrize("search", ["random", "tpe"])
def test_search_proposes_the_budget_of_configurations_within_the_ranges(tmp_path, search):
    box = space(H=Int(2, 8, log=True), outer_lr=Float(0.3, 1.0), steps=[6, 10], seed=[0])
    rows = sweep(tiny, box, search=search, trials=5, out=tmp_path / search, progress=False).table()
    assert 1 <= len(rows) <= 5 and sum(r["attempts"] for r in rows) == 5  # a repeated point is one row
    for r in rows:
        assert 2 <= r["H"] <= 8 and 0.3 <= r["outer_lr"] <= 1.0 and r["steps"] in (6, 10) and r["seeds"] == 1


def test_objective_at_a_byte_budget_and_under_a_constraint(tmp_path):
    result = sweep(tiny, grid(H=[2, 5]), out=tmp_path / "s", budget_bytes=2000, max_bytes=3000, progress=False)
    for r in result.table():
        folder = Path(r["run_dirs"])
        sent = {0: 0.0} | {int(row["step"]): float(row["bytes"]) for row in _csv(folder / "train.csv")}
        within = [row for row in _csv(folder / "val.csv") if sent[int(row["step"])] <= 2000]
        assert r["objective"] == pytest.approx(float(within[-1]["global_loss"]))  # the last evaluation within budget
        assert r["feasible"] == (r["wire_bytes_per_node"] <= 3000)
    assert {r["feasible"] for r in result.table()} == {True, False}  # H=2 sends twice as often as H=5
    assert result.best()["H"] == 5  # an infeasible configuration is never the best


def _csv(path: Path) -> list[dict]:
    import csv
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_diverged_or_failed_configuration_is_recorded_and_the_sweep_goes_on(tmp_path):
    space_ = grid(poison=[False, True], fail=[False, True], seed=[0, 1])
    rows = {(r["poison"], r["fail"]): r for r in sweep(tiny, space_, out=tmp_path / "s", progress=False).table()}
    assert rows[False, False]["status"] == "completed"
    assert rows[True, False]["status"] == "diverged" and "nan" in rows[True, False]["error"]
    assert rows[True, False]["seeds"] == 0 and "seed=1" not in rows[True, False]["run_dirs"]  # seed 1 not tried
    assert rows[False, True]["status"] == "failed" and "fails on purpose" in rows[False, True]["error"]
    again = {(r["poison"], r["fail"]): r for r in
             sweep(tiny, space_, out=tmp_path / "s", resume=True, progress=False).table()}
    assert again[False, True]["attempts"] == 1  # failed ones are not retried unless asked
    retried = {(r["poison"], r["fail"]): r for r in
               sweep(tiny, space_, out=tmp_path / "s", resume=True, retry_failed=True, progress=False).table()}
    assert retried[False, True]["attempts"] == 2 and retried[False, True]["status"] == "failed"
    assert retried[False, False]["attempts"] == 1


def test_the_frontier_of_a_hand_built_set():
    rows = [{"name": n, "bytes": b, "loss": l} for n, b, l in
            [("a", 0, 3.0), ("b", 10, 2.0), ("c", 10, 2.5), ("d", 20, 2.2), ("e", 30, 1.0), ("f", 40, 1.0),
             ("g", 5, None)]]
    assert [r["name"] for r in pareto(rows, "bytes", "loss")] == ["a", "b", "e"]
    assert [r["name"] for r in pareto(rows, "bytes", "loss", maximize_y=True)] == ["a"]
    acc = [{"name": n, "bytes": b, "acc": a} for n, b, a in [("a", 1, 0.5), ("b", 2, 0.7), ("c", 3, 0.6)]]
    assert [r["name"] for r in pareto(acc, "bytes", "acc", maximize_y=True)] == ["a", "b"]


@pytest.mark.parametrize("make, match", [
    (lambda: grid(H=[]), "the list of values is empty"),
    (lambda: space(H=Int(10, 2)), r"the range 10..2 is empty"),
    (lambda: space(lr=Float(0.0, 1.0, log=True)), "a log range must lie above zero"),
    (lambda: space(H=Int(2.5, 8)), "Int low must be an int"),
    (lambda: grid(H=Int(2, 8)), "H is a range"),
    (lambda: grid(H=[1, 1]), "more than once"),
    (lambda: grid(H=[1], seed=[]), "the list of seeds is empty"),
    (lambda: grid(opt=[object()]), "values must be int, float, str, bool or None"),
    (lambda: Objective("val_los"), "unknown objective 'val_los'"),
    (lambda: Objective("held_out_loss", budget_bytes=5e6, extra_metrics=("held_out_loss",)),
     "a budget reads the objective from the run's rows"),
    (lambda: parse_bytes("5 parsecs", "budget_bytes"), "positive number of bytes"),
])
def test_bad_input_is_a_clear_error(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_bad_sweep_arguments_stop_before_any_trial(tmp_path):
    out = tmp_path / "s"
    for kwargs, match in [
        (dict(space=space(H=Int(2, 5))), "H is a range"),
        (dict(space=space(H=Int(2, 5)), search="tpe"), "needs trials=N"),
        (dict(space=grid(H=[2]), trials=3), "trials= is for"),
        (dict(space=grid(H=[2]), search="bayes"), "search must be one of"),
        (dict(space=grid(H=[2]), workers=0), "workers must be an int >= 1"),
        (dict(space=grid(H=[2]), objective="nope"), "unknown objective"),
        (dict(space=grid(H=[2]), workers=2, run=lambda c, r: None), "must be importable"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            sweep(kwargs.pop("run", tiny), out=out, progress=False, **kwargs)
        assert not out.exists()
    assert parse_bytes("5MB", "x") == 5e6 and parse_bytes("1.5 GiB", "x") == 1.5 * 2 ** 30
    sweep(tiny, grid(H=[2]), out=out, progress=False)
    with pytest.raises(ValueError, match="was started differently"):
        sweep(tiny, grid(H=[2, 3]), out=out, resume=True, progress=False)


def test_an_objective_the_runs_do_not_have_stops_the_sweep_after_the_first(tmp_path):
    with pytest.raises(ValueError, match="'final_global_perplexity' is not among this run's metrics"):
        sweep(tiny, grid(H=[2, 3, 4]), objective="final_global_perplexity", out=tmp_path / "s", progress=False)
    assert len(list((tmp_path / "s" / "runs").iterdir())) == 1  # one run told, the other two never started


def test_a_parameter_the_run_function_never_reads_stops_the_sweep_after_the_first(tmp_path):
    with pytest.raises(ValueError, match=r"never read config\['outer_lrr'\]: it takes no such parameter"):
        sweep(tiny, grid(outer_lrr=[0.5, 0.7]), out=tmp_path / "s", progress=False)
    assert len(list((tmp_path / "s" / "runs").iterdir())) == 1
