"""What an asynchronous run records: updates, per-node time, goodput, loss against simulated time and updates."""

import csv
import json
import math

import pytest

import toy
from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy


def _run(tmp_path=None, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    t.fit(AsyncDiLoCoStrategy(H=4, lr=1e-2), 3, batch_size=8, max_steps=12, val_interval=4, node_speeds=[1, 0.5, 0.25],
          network="home", progress=False, device="cpu", **kw)
    return t


def test_the_record_holds_updates_time_per_node_goodput_and_val_rows_in_simulated_time(tmp_path):
    t = _run(logger=True, run_name="a")
    r = t.record
    assert len(r.updates) == 9 and [u["node"] for u in r.updates[:3]] == [0, 1, 2]
    assert all({"sim_time_s", "node", "staleness", "weight"} <= set(u) for u in r.updates)
    times = r.time_per_node
    for c, tm in zip(r.sim_time_per_node, times):  # compute + comm + idle = the run's simulated time, per node
        assert math.isclose(tm["compute_s"] + tm["comm_s"] + tm["idle_s"], r.sim_time_s, rel_tol=1e-9)
    assert math.isclose(r.goodput, sum(tm["compute_s"] for tm in times) / (3 * r.sim_time_s))
    # validation rows carry node 0's clock and the server's updates when it read the model
    assert [v["updates"] for v in r.val][0] == 0 and r.val[-1]["updates"] == 9
    assert all(a["sim_time_s"] <= b["sim_time_s"] for a, b in zip(r.val, r.val[1:]))
    # the CSV has loss against simulated time; summary.json the updates and goodput
    with open(tmp_path / "logs" / "a" / "train.csv") as f:
        assert "sim_time_s" in next(csv.DictReader(f))
    summary = json.loads((tmp_path / "logs" / "a" / "summary.json").read_text())
    assert summary["updates_applied"] == 9 and math.isclose(summary["goodput"], r.goodput)


def test_plot_loss_against_updates_and_simulated_time(tmp_path):
    pytest.importorskip("matplotlib")
    from exogym.runs.plot import plot_runs
    t = _run(logger=False)
    for x in ("updates", "sim_time_s"):
        assert plot_runs([t.record], x=x, out=tmp_path / f"{x}.png").exists()
