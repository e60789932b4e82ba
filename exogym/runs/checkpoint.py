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

A checkpoint folder belongs to one run (`CheckpointPlan.check_owner`, before any node starts): a run never writes
into a folder another run is writing, and never deletes a checkpoint (or a `.partial` folder) it did not write,
unless overwrite=True asked it to replace another run's that has ended. A full disk is a DiskFullError naming the
file, what it needed and what was free; the failed checkpoint's `.partial` folder is removed, and the newest
complete checkpoint stays as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from exogym.comm.transport import CommStats
from exogym.runs.disk import DiskFullError, disk_full, drop_frames, format_bytes, free_bytes, is_disk_full
from exogym.runs.fingerprint import fingerprint_differences
from exogym.runs.folder import RunClaim, hold_folder, remove_tree
from exogym.runs.marker import MARKER, describe_holder, read_marker
from exogym.runs.record import NodeLog
from exogym.cluster.simtime import NodeClock
from exogym.runs.checkpoint_checks import CheckpointError, check_node_state

__all__ = ["NodeState", "CheckpointPlan", "CheckpointError", "save_node_state", "finalize_checkpoint",
           "find_checkpoint", "read_manifest", "check_resume", "load_checkpoint", "check_checkpoint_space", "FORMAT"]

FORMAT = 2  # 1: pickled objects (before exogym 0.1's state protocol); 2: tensors and plain data
_PREFIX, _PARTIAL, _MANIFEST = "step_", ".partial", "manifest.json"
_COMPLETE = re.compile(r"step_\d+")  # a published checkpoint's folder name (a .partial one is not)
_NOT_OURS = "partials_of_others"  # the holder's marker lists the .partial folders that were there before it


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

    def check_owner(self, overwrite: bool = False, *, claim: RunClaim | None = None) -> RunClaim:
        """Before any node starts (on the process that claims the run folders): claim the checkpoint folder for
        this run, which keeps it until the run ends. Refused (CheckpointError, naming the owner and what to do)
        while another run writes in it, whatever overwrite says, and when it holds checkpoints of another run
        that has ended, unless overwrite=True (they are deleted). The same run resuming (the manifests' run_id)
        continues in it. Returns `claim` (the run folders' RunClaim), or a new RunClaim where None, now holding
        the folder: release() or abandon() it with the run, which lets the folder go."""
        root = self.root
        if overwrite and root.is_symlink():
            raise CheckpointError(f"checkpoint_dir {str(root)!r} is a symbolic link to {os.readlink(root)!r}; "
                                  "overwrite=True deletes checkpoints only inside a real folder: pass the folder the "
                                  "link points to as checkpoint_dir, or drop overwrite=True")
        claim = claim if claim is not None else RunClaim(self.config.get("run_name") or root.name, self.run_id)
        newly = root not in claim.held
        # Unfinished checkpoints already there are this run's only when its own earlier attempt held the folder
        # (and its marker did not list them as another's).
        previous = read_marker(root)
        theirs = sorted(root.glob(f"{_PREFIX}*{_PARTIAL}"))
        if previous.get("run_id") == self.run_id:
            theirs = [p for p in theirs if p.name in previous.get(_NOT_OURS, ())]
        holder = hold_folder(root, claim, run_id=self.run_id, run_name=self.config.get("run_name"),
                             note={_NOT_OURS: [p.name for p in theirs]} if theirs and not overwrite else None)
        if holder is not None:
            raise CheckpointError(_in_use(root, holder))
        others = [p for p in _complete(root) if _run_id_of(p) != self.run_id]
        if others and not overwrite:
            if newly:
                claim.let_go(root)
            raise CheckpointError(_held_by_another(root, others[-1]))
        if overwrite:  # the other runs' checkpoints, finished or not, are deleted, as asked
            for p in others + theirs:
                remove_tree(p)
        return claim


def save_node_state(plan: CheckpointPlan, rank: int, state: NodeState) -> None:
    """Write node `rank`'s file into the step's `.partial` folder. A disk without room for it (its tensors' bytes,
    a lower bound of the file's size) fails before writing; a write failing on a full disk removes the `.partial`
    folder, as the checkpoint cannot complete. Both are a DiskFullError naming the file."""
    folder = plan.folder(state.step, partial=True)
    folder.mkdir(parents=True, exist_ok=True)
    plain = state.to_plain(rank)
    file, needed = folder / f"node{rank}.pt", _tensor_bytes(plain)
    tmp = file.with_name(file.name + ".tmp")
    free = free_bytes(folder)
    try:
        if free is not None and free < needed:
            raise _checkpoint_full(plan, file, f"node {rank}'s checkpoint file", needed)
        torch.save(plain, tmp)
        os.replace(tmp, file)
    except Exception as e:
        full = is_disk_full(e, folder, needed, free=free)
        if full:
            drop_frames(e)  # else torch's writer keeps the unlinked file's space for as long as the error lives
        tmp.unlink(missing_ok=True)
        if not full:
            raise
        remove_tree(folder)  # the newest complete checkpoint stays the one to resume from
        if isinstance(e, DiskFullError):
            raise
        raise _checkpoint_full(plan, file, f"node {rank}'s checkpoint file", needed) from e


def finalize_checkpoint(plan: CheckpointPlan, step: int) -> Path:
    """Called once, after every node saved: write the manifest, publish the folder, drop this run's old ones."""
    partial, final = plan.folder(step, partial=True), plan.folder(step)
    num_nodes = plan.config["num_nodes"]
    files = {f"node{r}.pt": {"rank": r, "sha256": _sha256(partial / f"node{r}.pt")} for r in range(num_nodes)}
    manifest = {"format": FORMAT, "step": step, "num_nodes": num_nodes, "run_id": plan.run_id,
                "run_name": plan.config.get("run_name"), "written_by": {"pid": os.getpid(), "host": socket.gethostname()},
                "fingerprint": plan.fingerprint, "files": files, "config": plan.config}
    text = json.dumps(manifest, indent=2, default=repr)
    try:
        with open(partial / _MANIFEST, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if not is_disk_full(e, partial):
            raise
        remove_tree(partial)
        raise _checkpoint_full(plan, partial / _MANIFEST, "the checkpoint's manifest", len(text.encode())) from e
    if final.exists():
        if _run_id_of(final) != plan.run_id:
            remove_tree(partial)
            raise CheckpointError(f"checkpoint {str(final)!r} belongs to another run and is left as it is; give this "
                                  "run a checkpoint_dir of its own")
        remove_tree(final)  # this run's own, from before a resume
    os.replace(partial, final)
    own = [p for p in _complete(plan.root) if _run_id_of(p) == plan.run_id]
    for old in own[:-plan.keep]:
        _remove_quietly(old)
    held = read_marker(plan.root)
    if held.get("run_id") == plan.run_id:  # the folder is this run's: a .partial in it was left by its own crash
        for stale in plan.root.glob(f"{_PREFIX}*{_PARTIAL}"):
            if stale != partial and stale.name not in held.get(_NOT_OURS, ()):
                _remove_quietly(stale)
    return final


def check_checkpoint_space(root: str | os.PathLike, model: torch.nn.Module, num_nodes: int) -> None:
    """Before any node starts: refuse (DiskFullError) a checkpoint folder whose disk has less free space than one
    checkpoint needs at least: num_nodes copies of the model's state (parameters and buffers). The optimizer's and
    the strategy's state come on top, unknown before the run, so a pass does not promise that saves succeed."""
    per_node = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    needed, free = num_nodes * per_node, free_bytes(root)
    if free is not None and free < needed:
        raise DiskFullError(f"not enough disk space for one checkpoint: checkpoint_dir {str(root)!r} needs at least "
                            f"{format_bytes(needed)} (num_nodes={num_nodes} x {format_bytes(per_node)} of model "
                            f"state, before the optimizer's) but its disk has {format_bytes(free)} free; free space "
                            "there, pass a checkpoint_dir on another disk, or drop checkpoint_interval", root, needed,
                            free)


def _checkpoint_full(plan: CheckpointPlan, path: Path, what: str, needed: int) -> DiskFullError:
    newest = [p for p in _complete(plan.root) if _run_id_of(p) == plan.run_id]
    kept = f"; the newest complete checkpoint, {str(newest[-1])!r}, is kept" if newest else ""
    return disk_full(path, what, needed=needed, at_least=True, hint=kept)


def _tensor_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """The bytes of the tensors in a node state (each storage once): what torch.save writes, less its overhead."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a sparse or other storage-less tensor: its values, at least
            return obj.numel() * obj.element_size()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    return 0


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
        check_node_state(plain, manifest["num_nodes"], file)
        if plain.get("rank") != rank or state.step != manifest["step"]:
            raise CheckpointError(f"checkpoint file {str(file)!r} holds node {plain.get('rank')}'s state at step "
                                  f"{state.step}, not node {rank}'s at step {manifest['step']}")
        states.append(state)
    return states


def _complete(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _COMPLETE.fullmatch(p.name) and (p / _MANIFEST).exists())


def _run_id_of(folder: Path) -> str | None:
    try:
        return read_manifest(folder)["run_id"]
    except CheckpointError:
        return None


def _remove_quietly(path: Path) -> None:
    try:
        remove_tree(path)
    except OSError:
        pass  # an old checkpoint that cannot be removed costs space, not the run


def _in_use(root: Path, holder: dict[str, Any]) -> str:
    who = describe_holder(holder)
    if holder.get("kind") == "checkpoints" or holder.get("status") == "unreadable":
        return (f"checkpoint_dir {str(root)!r} is in use by a run that has not ended ({who}); two runs writing one "
                "checkpoint folder would delete each other's checkpoints, so overwrite=True is refused too: choose "
                f"another checkpoint_dir, or resume that run with resume_from={str(root)!r} once it has ended. If "
                f"that run is gone, delete {str(root / MARKER)!r}")
    return f"checkpoint_dir {str(root)!r} is the run folder of another run ({who}); choose another checkpoint_dir"


def _held_by_another(root: Path, newest: Path) -> str:
    try:
        manifest = read_manifest(newest)
    except CheckpointError:
        owner = "whose manifest is unreadable"
    else:
        by = manifest.get("written_by") if isinstance(manifest.get("written_by"), dict) else {}
        owner = (f"of run {manifest.get('run_name')!r}, run id {manifest['run_id']}"
                 + (f", written by process {by.get('pid')} on {by.get('host')}" if by else "") + ", which has ended")
    return (f"checkpoint_dir {str(root)!r} holds checkpoints of another run ({newest.name} {owner}); resume it with "
            f"resume_from={str(root)!r}, choose another checkpoint_dir or run_name, or pass overwrite=True to delete "
            "them")


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
