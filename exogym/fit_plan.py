"""The parts of one Trainer.fit call: its arguments checked, its data, where it resumes, the record's config, and
the plan they make (FitPlan: data, before anything is claimed, started or printed)."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from exogym._validation import MAX_SEED, check_int, check_number
from exogym.backends.sim.fused.choose import EXECUTIONS
from exogym.cluster.membership import Membership
from exogym.data.partition import Partition
from exogym.data.sharding import NodeBatches
from exogym.engine.devices import MemoryCap
from exogym.engine.plan import RunPlan
from exogym.fit_setup import check_node_memory, take_ignored_settings, versions
from exogym.runs.checkpoint import NodeState, check_resume, find_checkpoint, load_checkpoint, read_manifest
from exogym.runs.loggers import Logger
from exogym.strategy.base import Strategy

__all__ = ["FitArguments", "check_arguments", "check_processes", "RunData", "ResumePoint", "resume_point", "run_config", "FitPlan",
           "CheckpointSpec", "keeps_one_replica"]


class FitArguments(SimpleNamespace):
    """fit's keyword arguments, by name (fit's signature is where they are declared and documented)."""


def check_arguments(o: FitArguments) -> None:
    """The checks that need nothing but the arguments themselves, in the order fit lists them. First, the settings
    an adapter of this call noted as having no effect are taken (o.ignored: config.json lists them apart)."""
    o.ignored = take_ignored_settings()
    if not isinstance(o.strategy, Strategy):
        raise TypeError(f"strategy must be an exogym Strategy instance, got {o.strategy!r}")
    o.strategy.check_constructed()
    for name in ("num_nodes", "num_epochs", "batch_size", "val_size", "val_interval", "log_interval",
                 "keep_checkpoints"):
        check_int(name, getattr(o, name), minimum=1)
    check_node_memory(o.num_nodes)  # the per-node overhead alone: num_nodes=10**9 is refused here, at once
    o.strategy.check_nodes(o.num_nodes)
    check_int("seed", o.seed, minimum=0, maximum=MAX_SEED)
    for name in ("max_steps", "minibatch_size", "checkpoint_interval", "diagnostics_interval", "port"):
        check_int(name, getattr(o, name), minimum=1, allow_none=True)
    if o.port is not None and o.port > 65535:
        raise ValueError(f"port must be a TCP port in 1..65535, got {o.port}")
    if o.extra_config is not None and not isinstance(o.extra_config, dict):
        raise TypeError(f"extra_config (the original's fit(kwargs=...)) must be a dict, got {o.extra_config!r}")
    for name in ("extend_run", "overwrite"):
        if not isinstance(getattr(o, name), bool):
            raise TypeError(f"{name} must be True or False, got {getattr(o, name)!r}")
    if o.extend_run and o.resume_from is None:
        raise TypeError("extend_run=True continues a checkpointed run past its planned length; it needs resume_from=")
    check_number("node_timeout", o.node_timeout, positive=True, allow_none=True)
    if o.node_timeout is not None and not math.isfinite(o.node_timeout):
        raise ValueError(f"node_timeout must be a finite number of seconds or None (no limit), got {o.node_timeout}")
    if o.overwrite and o.resume_from is not None:
        raise ValueError("overwrite=True would delete the run that resume_from continues; drop one of them")
    if o.execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {o.execution!r}")


def check_processes(o: FitArguments) -> None:
    """processes=P: how many processes share the simulation (backend="sim"), each a block of nodes."""
    check_int("processes", o.processes, minimum=1)
    if o.processes > 1 and o.backend != "sim":
        raise ValueError(f"processes={o.processes} spreads the sim backend's nodes over processes; backend={o.backend!r} "
                         "already runs one process per node: drop processes=")
    if o.processes > o.num_nodes:
        raise ValueError(f"processes={o.processes} is more than num_nodes={o.num_nodes}: each process simulates at "
                         f"least one node; use processes <= {o.num_nodes}")


def keeps_one_replica(strategy: Strategy) -> bool:
    """Whether sequential nodes of this strategy share one replica (DDP's one_replica): they then take one
    optimizer step per step between them, which execution="auto" must compare against."""
    return bool(getattr(type(strategy), "one_replica", False))


@dataclass
class RunData:
    """Every node's batches and the fixed validation batches, and the step counts they imply."""

    split: Partition | None
    node_batches: list[NodeBatches]
    steps_per_epoch: int
    total_steps: int
    val_batches: list[Any] | None
    val_size: int
    membership: Membership | None


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


def run_config(o: FitArguments, *, model: torch.nn.Module, data: RunData, time_model: Any,
               devices: list[torch.device], loader: dict[str, Any], execution: tuple[str, str]) -> dict[str, Any]:
    """The run's config.json: every setting that shapes it, given or derived; the settings that had no effect are
    listed apart, under "ignored" (name -> value and why)."""
    ignored = dict(getattr(o, "ignored", {}))
    ignored.update({f"strategy.{k}": v for k, v in o.strategy.ignored_settings.items()})
    if o.max_steps is not None and o.num_epochs != 1:  # 1: fit's default, not a setting
        ignored["num_epochs"] = {"value": o.num_epochs, "reason": f"max_steps={o.max_steps} sets the run's length"}
    config = {"strategy": type(o.strategy).__name__, "strategy_config": o.strategy.config(),
              "num_nodes": o.num_nodes, "max_steps": data.total_steps, "steps_per_epoch": data.steps_per_epoch,
              **({} if "num_epochs" in ignored else {"num_epochs": o.num_epochs}), "batch_size": o.batch_size,
              "minibatch_size": o.batch_size if o.minibatch_size is None else o.minibatch_size,
              "global_batch": o.num_nodes * o.batch_size, "shuffle": o.shuffle,
              "val_size": data.val_size if data.val_batches else 0, "val_interval": o.val_interval,
              "log_interval": o.log_interval, "seed": o.seed, "backend": o.backend, "autocast": o.autocast,
              "execution": execution[0], "execution_reason": execution[1], "devices": [str(d) for d in devices],
              "model": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
              "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "versions": versions()}
    if ignored:
        config["ignored"] = ignored
    if o.dataloader_kwargs is not None:
        config["dataloader_kwargs"] = {"given": dict(o.dataloader_kwargs), "applied": loader}
    if o.max_memory_usage is not None:
        config["max_memory_usage"] = o.max_memory_usage
    if o.port is not None:
        config["port"] = o.port
    if o.extra_config is not None:
        config["extra"] = dict(o.extra_config)
    if data.split is not None:
        config["partition"] = {"kind": o.partition, **data.split.settings, "sizes": data.split.sizes,
                               "label_histograms": data.split.label_histograms()}
    if data.membership is not None:
        config["membership"] = {"failures": repr(o.failures), "active_nodes": repr(o.active_nodes),
                                "schedule": data.membership.as_record()}
    if time_model is not None:
        config["time_model"] = {"network": repr(time_model.network), "node_speeds": list(time_model.node_speeds),
                                "device_flops": list(time_model.device_flops), "compute_time": o.compute_time}
    return config


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often a run saves: `root` None is the run folder's checkpoints/ (known once it is claimed)."""

    root: Path | None
    interval: int
    keep: int


@dataclass
class FitPlan:
    """What a fit call will do, checked and built before anything is claimed, started or printed
    (exogym.lifecycle.RunLifecycle does those).

    Attributes:
        run: the plan the launcher's processes run (its checkpoints are set once the run folder is claimed).
        launcher: who runs it.
        config: the record's config (run_name and processes are added as the run opens).
        logger: the run's loggers (None: none, or not the main process).
        run_name: the run's explicit name (None: a default name is claimed).
        resumed: where the run starts.
        fingerprint: what a checkpoint of this run must match.
        checkpoints: where and how often it saves (None: it does not).
        default_checkpoints: the checkpoints go under logs/<run_name>/ (fit's checkpoint_dir was not given).
        overwrite: fit's overwrite.
        devices: each node's device.
        memory_cap: the device memory caps applied while the run runs.
        time_model: the simulated time's model, for the run's announcement.
        log_interval: every log_interval-th step's row goes to the loggers.
        processes: what the record's config says of the processes.
        is_main: this process holds the run folders and the loggers.
        show_progress: the announcement and the progress bar are shown.
    """

    run: RunPlan
    launcher: Any
    config: dict[str, Any]
    logger: Logger | None
    run_name: str | None
    resumed: ResumePoint
    fingerprint: dict[str, Any]
    checkpoints: CheckpointSpec | None
    default_checkpoints: bool
    overwrite: bool
    devices: list[torch.device]
    memory_cap: MemoryCap
    time_model: Any
    log_interval: int
    processes: int
    is_main: bool
    show_progress: bool
