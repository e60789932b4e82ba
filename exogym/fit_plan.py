"""The parts of one Trainer.fit call: its arguments checked, its data, where it resumes, the record's config, and
the run on its way (what must be closed, released or reported however the run ends)."""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

from exogym._validation import MAX_SEED, check_int, check_number
from exogym.backends.sim.fused.choose import EXECUTIONS
from exogym.cluster.membership import Membership
from exogym.data.partition import Partition
from exogym.data.sharding import NodeBatches
from exogym.engine.devices import MemoryCap
from exogym.engine.plan import RunPlan
from exogym.fit_end import ending
from exogym.fit_setup import check_node_memory, versions
from exogym.runs.checkpoint import NodeState, check_resume, find_checkpoint, load_checkpoint, read_manifest
from exogym.runs.folder import RunClaim
from exogym.runs.loggers import Logger
from exogym.runs.progress import RunProgress
from exogym.runs.record import RunRecord
from exogym.strategy.base import Strategy

__all__ = ["FitArguments", "check_arguments", "check_processes", "RunData", "ResumePoint", "resume_point", "run_config", "FitRun",
           "keeps_one_replica"]


class FitArguments(SimpleNamespace):
    """fit's keyword arguments, by name (fit's signature is where they are declared and documented)."""


def check_arguments(o: FitArguments) -> None:
    """The checks that need nothing but the arguments themselves, in the order fit lists them. First, the settings
    the argument adapters of this call dropped as having no effect (o.ignored_settings, exogym.adapters) are kept as
    o.ignored: config.json lists them apart."""
    o.ignored = {k: {"value": v, "reason": why} for k, (v, why) in (o.ignored_settings or {}).items()}
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


def resume_point(resume_from: Any, fingerprint: dict[str, Any], devices: list[torch.device], *,
                 run_name: str | None, extend: bool, max_steps: int, announce: bool) -> ResumePoint:
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
    if announce:
        print(f"exogym: resuming run {manifest.get('run_name')!r} from step {manifest['step']} ({folder})", flush=True)
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


@dataclass
class FitRun:
    """One run on its way: the plan a backend starts, and what must be closed, released or reported however the
    run ends."""

    config: dict[str, Any]
    logger: Logger | None
    claim: RunClaim | None
    memory_cap: MemoryCap
    devices: list[torch.device]
    bar: RunProgress | None = None
    plan: RunPlan | None = None
    runner: Callable[[RunPlan], list[Any]] | None = None
    started: float = field(default_factory=time.perf_counter)

    def abandon(self) -> None:
        """Nothing ran: the bar goes, and the claimed run folder is given back."""
        if self.bar is not None:
            self.bar.close()
        if self.claim is not None:
            self.claim.abandon()

    def fail(self, error: BaseException) -> RunRecord | None:
        """The nodes ran and stopped part-way: the record of every step they all completed (also to the loggers),
        and the loggers and the run folder say how the run ended (exogym.fit_end.ending)."""
        record = None
        if self.plan is not None:
            with contextlib.suppress(Exception):  # e.g. a full disk under the logger: the record keeps the row
                self.plan.live.log_newest_row()
            record = RunRecord.from_nodes(self.plan.live.partial_logs(), config=self.config,
                                          global_batch=self.config["global_batch"],
                                          wall_time_s=time.perf_counter() - self.started)
        end = ending(error, self.plan.checkpoints.root if self.plan is not None and self.plan.checkpoints else None)
        if self.bar is not None:
            self.bar.close()
        if self.logger is not None:
            self.logger.finish({**end, **(record.summary() if record is not None else {})})
        if self.claim is not None:
            self.claim.release(end["status"], end.get("error"))
        return record

    @property
    def folder(self) -> str | None:
        """The run folder (the first, when the loggers write several), once claimed; None when there is none (a
        run that failed before its first training row gives its folder back)."""
        folders = [f for f in self.claim.folders if f.is_dir()] if self.claim is not None else []
        return str(folders[0]) if folders else None
