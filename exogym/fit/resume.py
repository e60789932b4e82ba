"""Where a fit call starts: from scratch (a new run id), or from a checkpoint of the same run, checked against it
before any node starts."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch

from exogym.runs.checkpoint import NodeState, check_resume, find_checkpoint, load_checkpoint, read_manifest

__all__ = ["ResumePoint", "resume_point"]


@dataclass
class ResumePoint:
    """Where a run starts: from scratch (a new run id), or from a checkpoint of the same run."""

    run_id: str
    states: list[NodeState] | None = None  # per node
    step: int = 0
    run_name: str | None = None  # the resumed run's own name, when it continues in its own folder
    after: int | None = None  # that folder's rows after this step are dropped
    record: dict[str, Any] | None = None  # what the record's config says of the resume
    message: str | None = None  # what the run's start says of the resume


def resume_point(resume_from: Any, fingerprint: dict[str, Any], devices: list[torch.device], *,
                 run_name: str | None, extend: bool, max_steps: int) -> ResumePoint:
    """The same run, or a refusal listing what differs, before any node starts."""
    if resume_from is None:
        return ResumePoint(uuid.uuid4().hex)
    folder = find_checkpoint(resume_from)
    manifest = read_manifest(folder)
    check_resume(manifest, folder, fingerprint, extend=extend)
    point = ResumePoint(manifest["run_id"], load_checkpoint(folder, manifest, devices=devices), manifest["step"])
    saved_name = manifest.get("run_name")
    if isinstance(saved_name, str) and run_name in (None, saved_name):  # that very run: its own folder
        point.run_name, point.after = saved_name, manifest["step"]
    point.record = {"checkpoint": str(folder), "step": manifest["step"]}
    if manifest["fingerprint"].get("max_steps") != max_steps:
        point.record["extended"] = {
            "from_max_steps": manifest["fingerprint"]["max_steps"], "to_max_steps": max_steps,
            "lr_schedule": "kept its original length: after it ends, its last learning rate continues"}
    point.message = f"exogym: resuming run {manifest.get('run_name')!r} from step {manifest['step']} ({folder})"
    return point
