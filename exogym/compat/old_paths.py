"""Import paths that earlier layouts of this package and the original EXO Gym documented, kept working.

Each old module path names the module that holds those names now (`import exogym.logger` gives
exogym.runs.loggers itself, not a copy), so classes keep one identity whichever path imported them; an old name
(`from exogym import TrainNode`) is the object of that name now. What the original's README and llms.txt name and
this library has not is listed on docs/coming_from_exogym.md with what to write instead (a test reads both files).
"""

from __future__ import annotations

import importlib
import sys
import types

__all__ = ["OLD_PATHS", "OLD_NAMES", "install"]

# old module path -> the module that holds its names now
OLD_PATHS = {
    "exogym.logger": "exogym.runs.loggers",
    "exogym.plot": "exogym.runs.plot",
    "exogym.record": "exogym.runs.record",
    "exogym.checkpoint": "exogym.runs.checkpoint",
    "exogym.run_folder": "exogym.runs.folder",
    "exogym.progress": "exogym.runs.progress",
    "exogym.network": "exogym.cluster.network",
    "exogym.simtime": "exogym.cluster.simtime",
    "exogym.membership": "exogym.cluster.membership",
    "exogym.devices": "exogym.engine.devices",
    "exogym.rng": "exogym.engine.rng",
    "exogym.model_call": "exogym.engine.model_call",
    "exogym.global_model": "exogym.engine.global_model",
    "exogym.averaging": "exogym.engine.global_model",
    "exogym.compression": "exogym.comm.compression",
    "exogym.flatten": "exogym.comm.flatten",
    "exogym.strategy.communicate": "exogym.comm.collectives",
    "exogym.strategy.mean": "exogym.comm.mean",
    "exogym.strategy.compressed_reduce": "exogym.comm.mean",
    "exogym.strategy.strategy": "exogym.compat.strategy_module",
    "exogym.aux.utils": "exogym.compat.aux_utils",
    "exogym.fused": "exogym.backends.sim.fused",
    # the original EXO Gym's layout (its llms.txt): the per-rank loop, the settings handed to the ranks, its aux/
    # package's loggers, DeMo's optimizer
    "exogym.trainer": "exogym.fit.trainer",
    "exogym.train_node": "exogym.engine.node",
    "exogym.common": "exogym.engine.config",
    "exogym.aux.logger": "exogym.runs.loggers",
    "exogym.strategy.demo_impl.demo": "exogym.strategy.demo",
}

# old name -> (the module that holds it now, its name there)
OLD_NAMES = {
    "exogym.TrainNode": ("exogym.engine.node", "TrainNode"),
}


def install() -> None:
    """Make every old path importable (`import a.b`, `from a.b import x`, `from a import b`)."""
    for old, new in OLD_PATHS.items():
        _bind(old, importlib.import_module(new))
    for old, (module, name) in OLD_NAMES.items():
        parent, _, leaf = old.rpartition(".")
        setattr(sys.modules[parent], leaf, getattr(importlib.import_module(module), name))


def _bind(path: str, module: types.ModuleType) -> None:
    sys.modules[path] = module
    parent_path, _, leaf = path.rpartition(".")
    parent = sys.modules.get(parent_path)
    if parent is None:  # a package that no longer exists (exogym.aux): an empty one holding the old modules
        parent = types.ModuleType(parent_path, f"The old import path {parent_path}, kept by exogym.compat.")
        parent.__path__ = []
        _bind(parent_path, parent)
    setattr(parent, leaf, module)
