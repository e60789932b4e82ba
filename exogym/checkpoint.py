"""Checkpoints: each node's model, strategy, random streams, data position, byte counts and log.

A checkpoint is a folder `step_000120/` holding `node<r>.pt` for every node and a
`manifest.json` written last. Nodes write into `step_000120.partial/`, which is renamed only
once every node's file and the manifest are on disk, so a crash never leaves a half-written
checkpoint that looks complete. The strategy object is saved whole, together with the model
in one pickle so its optimizers keep pointing at the model's parameters: outer optimizers,
momentum, error-feedback residuals and schedules all come back exactly.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exogym.comm import CommStats
from exogym.record import NodeLog
from exogym.rng import GlobalRNGState
from exogym.simtime import NodeClock

__all__ = ["NodeState", "CheckpointPlan", "CheckpointError", "save_node_state", "finalize_checkpoint",
           "find_checkpoint", "load_checkpoint"]

_PREFIX, _PARTIAL, _MANIFEST = "step_", ".partial", "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or from a different run configuration."""


@dataclass
class NodeState:
    """Everything one node needs to continue exactly where it stopped."""

    step: int  # optimizer steps done
    model: torch.nn.Module
    strategy: Any
    rng: GlobalRNGState
    comm_stats: CommStats
    log: NodeLog
    clock: NodeClock


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run saves: every `interval` steps (and at the end) into `root`, keeping the
    newest `keep`; `config` (the run's configuration) goes into each manifest."""

    root: Path
    interval: int
    keep: int
    config: dict[str, Any]

    def due(self, done: int, max_steps: int) -> bool:
        return done % self.interval == 0 or done == max_steps

    def folder(self, step: int, partial: bool = False) -> Path:
        return self.root / f"{_PREFIX}{step:09d}{_PARTIAL if partial else ''}"


def save_node_state(plan: CheckpointPlan, rank: int, state: NodeState) -> None:
    folder = plan.folder(state.step, partial=True)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"node{rank}.pt.tmp"
    try:
        torch.save(state, tmp)
    except (AttributeError, TypeError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "pickle" not in str(e).lower():
            raise
        raise TypeError(f"node {rank} cannot save a checkpoint: its model or strategy does not pickle ({e}); "
                        "define models, strategies and schedule functions at module level, not as lambdas "
                        "or local classes") from e
    os.replace(tmp, folder / f"node{rank}.pt")


def finalize_checkpoint(plan: CheckpointPlan, step: int) -> Path:
    """Called once, after every node saved: write the manifest, publish the folder, drop old checkpoints."""
    partial, final = plan.folder(step, partial=True), plan.folder(step)
    manifest = {"step": step, "num_nodes": plan.config["num_nodes"], "config": plan.config}
    with open(partial / _MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, default=repr)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    complete = sorted(p for p in plan.root.iterdir() if p.name.startswith(_PREFIX) and (p / _MANIFEST).exists())
    for old in complete[:-plan.keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in plan.root.glob(f"{_PREFIX}*{_PARTIAL}"):  # left by a crash before this save
        if stale != partial:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` is a checkpoint folder, or a folder of them (the newest complete one is taken)."""
    path = Path(path)
    if (path / _MANIFEST).exists():
        return path
    if path.is_dir():
        complete = sorted(p for p in path.iterdir() if p.name.startswith(_PREFIX) and (p / _MANIFEST).exists())
        if complete:
            return complete[-1]
    raise CheckpointError(f"no complete checkpoint at {str(path)!r}: expected a folder with {_MANIFEST} "
                          f"(e.g. {_PREFIX}000000100/) or a folder containing such folders")


def load_checkpoint(path: str | os.PathLike, *, num_nodes: int, batch_size: int, max_steps: int,
                    devices: list[torch.device]) -> list[NodeState]:
    """Read and check every node's state before any node starts; errors name the file and the fix."""
    folder = find_checkpoint(path)
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the manifest of checkpoint {str(folder)!r} is unreadable: {e}") from e
    saved = manifest["config"]
    if manifest["num_nodes"] != num_nodes or saved["batch_size"] != batch_size:
        raise CheckpointError(f"checkpoint {str(folder)!r} was written by a run with num_nodes={manifest['num_nodes']}, "
                              f"batch_size={saved['batch_size']}; resume with the same values "
                              f"(got num_nodes={num_nodes}, batch_size={batch_size})")
    if manifest["step"] >= max_steps:
        raise CheckpointError(f"checkpoint {str(folder)!r} is at step {manifest['step']}, not before max_steps="
                              f"{max_steps}; nothing is left to train")
    states = []
    for rank in range(num_nodes):
        file = folder / f"node{rank}.pt"
        try:
            state = torch.load(file, map_location=devices[rank], weights_only=False)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing to the user
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing, truncated or corrupted ({type(e).__name__}: "
                                  f"{e}); resume from an earlier checkpoint in {str(folder.parent)!r}") from e
        if not isinstance(state, NodeState) or state.step != manifest["step"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} does not hold node {rank}'s state at step "
                                  f"{manifest['step']}")
        states.append(state)
    return states
