"""Checkpoints: each node's model, strategy state, random streams, data position, byte counts, clock and log.

A checkpoint is a folder `step_000000120/` holding `node<r>.pt` for every node and a `manifest.json`
written last. Nodes write into `step_000000120.partial/`, which is renamed only once every node's file and
the manifest are on disk, so a crash never leaves a half-written checkpoint that looks complete.

What a node file may contain: tensors and plain data (numbers, strings, lists, tuples, dicts) only: the
model's state_dict, the strategy's state_dict (exogym.strategy.Strategy: optimizers, outer models,
residuals, schedules, step count), the random streams, byte counts, the virtual clock and the log. It is
read with torch.load(weights_only=True), so loading a file runs no code from it. The manifest holds the
run's identity (run_id, run_name), its fingerprint (exogym.runs.fingerprint) and, per node file, the rank it
belongs to and its sha256: a flipped bit, a truncated or swapped file is an error naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from exogym.comm.transport import CommStats
from exogym.runs.fingerprint import fingerprint_differences
from exogym.runs.record import NodeLog
from exogym.cluster.simtime import NodeClock

__all__ = ["NodeState", "CheckpointPlan", "CheckpointError", "save_node_state", "finalize_checkpoint",
           "find_checkpoint", "read_manifest", "check_resume", "load_checkpoint", "FORMAT"]

FORMAT = 2  # 1: pickled objects (before exogym 0.1's state protocol); 2: tensors and plain data
_PREFIX, _PARTIAL, _MANIFEST = "step_", ".partial", "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or from a different run configuration."""


@dataclass
class NodeState:
    """Everything one node needs to continue exactly where it stopped."""

    step: int  # optimizer steps done
    model: dict[str, torch.Tensor]  # model.state_dict()
    strategy: dict[str, Any]  # strategy.state_dict(): {"global": ..., "local": ...}
    rng: dict[str, Any]  # the node's random streams (exogym.engine.rng.GlobalRNGState.to_plain)
    comm_stats: CommStats
    log: NodeLog
    clock: NodeClock

    def to_plain(self, rank: int) -> dict[str, Any]:
        return {"format": FORMAT, "rank": rank, "step": self.step, "model": self.model, "strategy": self.strategy,
                "rng": self.rng, "comm_stats": asdict(self.comm_stats), "log": asdict(self.log),
                "clock": asdict(self.clock)}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> "NodeState":
        return cls(d["step"], d["model"], d["strategy"], d["rng"],
                   CommStats(**d["comm_stats"]), NodeLog(**d["log"]), NodeClock(**d["clock"]))


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run saves: every `interval` steps (and at the end) into `root`, keeping the
    newest `keep` of this run's own; the manifest records `config`, the run's `run_id` and `fingerprint`."""

    root: Path
    interval: int
    keep: int
    config: dict[str, Any]
    run_id: str
    fingerprint: dict[str, Any]

    def due(self, done: int, max_steps: int) -> bool:
        return done % self.interval == 0 or done == max_steps

    def folder(self, step: int, partial: bool = False) -> Path:
        return self.root / f"{_PREFIX}{step:09d}{_PARTIAL if partial else ''}"

    def check_owner(self, overwrite: bool = False) -> None:
        """Before any node starts: the folder holds no other run's checkpoints (pruning and a later resume would
        mix the two runs), unless overwrite=True, which deletes them."""
        others = [p for p in _complete(self.root) if _run_id_of(p) != self.run_id]
        if not others:
            return
        if overwrite:
            for p in others:
                shutil.rmtree(p)
            return
        raise CheckpointError(f"checkpoint_dir {str(self.root)!r} holds checkpoints of another run ({others[-1].name} "
                              f"of run {_run_id_of(others[-1])!r}); resume it with resume_from={str(self.root)!r}, "
                              "choose another checkpoint_dir or run_name, or pass overwrite=True to delete them")


def save_node_state(plan: CheckpointPlan, rank: int, state: NodeState) -> None:
    folder = plan.folder(state.step, partial=True)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"node{rank}.pt.tmp"
    torch.save(state.to_plain(rank), tmp)
    os.replace(tmp, folder / f"node{rank}.pt")


def finalize_checkpoint(plan: CheckpointPlan, step: int) -> Path:
    """Called once, after every node saved: write the manifest, publish the folder, drop this run's old ones."""
    partial, final = plan.folder(step, partial=True), plan.folder(step)
    num_nodes = plan.config["num_nodes"]
    files = {f"node{r}.pt": {"rank": r, "sha256": _sha256(partial / f"node{r}.pt")} for r in range(num_nodes)}
    manifest = {"format": FORMAT, "step": step, "num_nodes": num_nodes, "run_id": plan.run_id,
                "run_name": plan.config.get("run_name"), "fingerprint": plan.fingerprint, "files": files,
                "config": plan.config}
    with open(partial / _MANIFEST, "w") as f:
        json.dump(manifest, f, indent=2, default=repr)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    own = [p for p in _complete(plan.root) if _run_id_of(p) == plan.run_id]
    for old in own[:-plan.keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in plan.root.glob(f"{_PREFIX}*{_PARTIAL}"):  # left by a crash before this save
        if stale != partial:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def find_checkpoint(path: str | os.PathLike) -> Path:
    """`path` is a checkpoint folder, a folder of them (the newest complete one is taken), or a run folder
    (logs/<run>) holding them in checkpoints/."""
    path = Path(path)
    if (path / _MANIFEST).exists():
        return path
    for folder in (path, path / "checkpoints"):
        complete = _complete(folder)
        if complete:
            return complete[-1]
    raise CheckpointError(f"no complete checkpoint at {str(path)!r}: expected a folder with {_MANIFEST} "
                          f"(e.g. {_PREFIX}000000100/), a folder containing such folders, or a run folder with "
                          "checkpoints/ in it")


_MANIFEST_FIELDS = {"format": int, "step": int, "num_nodes": int, "run_id": str, "fingerprint": dict, "files": dict,
                    "config": dict}


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of checkpoint `folder`, checked field by field."""
    file = folder / _MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the manifest {str(file)!r} is unreadable: {e}") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"the manifest {str(file)!r} is not a JSON object")
    if manifest.get("format") == 1 or ("format" not in manifest and "config" in manifest):
        raise CheckpointError(f"checkpoint {str(folder)!r} was written by an earlier exogym (format 1: pickled "
                              "objects), which cannot be loaded without running code from the file; rerun the run")
    bad = [f"{k} (expected {t.__name__})" for k, t in _MANIFEST_FIELDS.items() if not isinstance(manifest.get(k), t)]
    if bad:
        raise CheckpointError(f"the manifest {str(file)!r} is malformed: missing or wrong {', '.join(bad)}")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {str(folder)!r} has format {manifest['format']}; this exogym reads "
                              f"format {FORMAT}")
    return manifest


def check_resume(manifest: dict[str, Any], folder: Path, fingerprint: dict[str, Any], *, extend: bool) -> None:
    """Refuse to resume a different experiment: every differing setting is listed with both values. A larger
    max_steps is allowed with extend=True (the record says what the schedule then does)."""
    diffs = fingerprint_differences(manifest["fingerprint"], fingerprint)
    saved_steps, steps = manifest["fingerprint"].get("max_steps"), fingerprint.get("max_steps")
    if extend and isinstance(saved_steps, int) and isinstance(steps, int) and steps > saved_steps:
        diffs = [d for d in diffs if d[0] != "max_steps"]
    if diffs:
        lines = "\n".join(f"  {key}: checkpoint {_short(a)}, this fit {_short(b)}" for key, a, b in diffs)
        hint = (" (to continue the run past its planned length, pass extend_run=True)"
                if any(k == "max_steps" for k, _, _ in diffs) else "")
        raise CheckpointError(f"checkpoint {str(folder)!r} belongs to a different run configuration than this fit "
                              f"call; resume with the same settings{hint}:\n{lines}")
    if manifest["step"] >= (steps if isinstance(steps, int) else 0):
        raise CheckpointError(f"checkpoint {str(folder)!r} is at step {manifest['step']}, not before max_steps="
                              f"{steps}; nothing is left to train (pass a larger max_steps with extend_run=True "
                              "to continue it)")


def load_checkpoint(folder: Path, manifest: dict[str, Any], *, devices: list[torch.device]) -> list[NodeState]:
    """Read, verify and load every node's state (before any node starts); errors name the file and the fix."""
    states = []
    for rank in range(manifest["num_nodes"]):
        name = f"node{rank}.pt"
        file = folder / name
        entry = manifest["files"].get(name)
        if not isinstance(entry, dict) or entry.get("rank") != rank or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"the manifest of {str(folder)!r} does not list {name} as node {rank}'s file")
        if not file.is_file() or _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} is missing, truncated or corrupted (its sha256 "
                                  f"differs from the manifest's); resume from an earlier checkpoint in "
                                  f"{str(folder.parent)!r}")
        try:
            plain = torch.load(file, map_location=devices[rank], weights_only=True)
            state = NodeState.from_plain(plain)
        except Exception as e:  # noqa: BLE001 - whatever fails to load, the file is not a checkpoint of ours
            raise CheckpointError(f"checkpoint file {str(file)!r} does not hold an exogym node state "
                                  f"({type(e).__name__}: {e})") from e
        if plain.get("rank") != rank or state.step != manifest["step"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} holds node {plain.get('rank')}'s state at step "
                                  f"{state.step}, not node {rank}'s at step {manifest['step']}")
        states.append(state)
    return states


def _complete(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(_PREFIX) and (p / _MANIFEST).exists())


def _run_id_of(folder: Path) -> str | None:
    try:
        return json.loads((folder / _MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
