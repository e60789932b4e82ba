"""The fit call's plan (exogym.fit.plan): frozen once built, complete but for what the run folder's claim decides, and
built without the fit package reaching into a backend's internals."""

import dataclasses
import json

import pytest

import toy
import exogym.fit.trainer as trainer_module
from exogym import Trainer
from exogym.backends.hosting import sequential_execution
from exogym.engine.execution import FusedFallbackWarning
from exogym.strategy import DiLoCoStrategy


def _spy(monkeypatch) -> dict:
    seen = {}

    class Spy(trainer_module.RunLifecycle):
        def __init__(self, plan):
            seen["plan"], seen["before"] = plan, json.dumps(dict(plan.config), default=repr, sort_keys=True)
            super().__init__(plan)
            seen["life"] = self

    monkeypatch.setattr(trainer_module, "RunLifecycle", Spy)
    return seen


def test_the_plan_is_not_changed_by_the_run_it_plans(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = _spy(monkeypatch)
    Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(
        DiLoCoStrategy(H=2), 2, max_steps=4, batch_size=8, checkpoint_interval=2, progress=False, device="cpu")
    plan, life = seen["plan"], seen["life"]
    assert json.dumps(dict(plan.config), default=repr, sort_keys=True) == seen["before"]  # open() added nothing
    assert "run_name" not in plan.config and plan.config["processes"] == 1  # complete but for the claimed name
    assert plan.run.checkpoints is None and life.run.checkpoints is not None  # the lifecycle's own copy
    assert life.config["run_name"] == life.record.config["run_name"] and life.claim.name == life.config["run_name"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.run = life.run
    with pytest.raises(TypeError):
        plan.config["run_name"] = "x"


def test_the_fit_package_asks_the_backend_for_the_execution():
    # fit/ names no module of a backend's inside; the sim's fused probe is reached through ProcessBackend.
    from pathlib import Path
    import ast
    root = Path(trainer_module.__file__).parent
    imported = {n.module for f in root.glob("*.py") for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.startswith(("exogym.backends.sim", "exogym.backends.torch"))]


def test_a_backend_running_each_node_on_its_own_refuses_fused_and_falls_back_from_auto():
    assert sequential_execution("sequential", backend="torch") == ("sequential", "requested")
    with pytest.raises(ValueError, match=r"execution='fused' cannot run here: .*got backend='torch'; use "
                                         r"execution='sequential'"):
        sequential_execution("fused", backend="torch")
    with pytest.warns(FusedFallbackWarning, match="runs the nodes sequentially"):
        assert sequential_execution("auto", backend="torch")[0] == "sequential"


def test_fused_on_the_torch_backend_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="execution='fused' cannot run here"):
        Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(
            DiLoCoStrategy(H=2), 2, max_steps=2, batch_size=8, backend="torch", execution="fused", progress=False)
    assert not (tmp_path / "logs").exists()
