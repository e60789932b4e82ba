"""A fit call's plan: from its checked configuration, the model and the data, everything a run needs before its
nodes start (every node's data, the record's config, where it resumes, the launcher and the RunPlan its processes
run), checked against the model, the data and the machine. Building it claims, starts and prints nothing:
exogym.fit.lifecycle opens the run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from exogym._validation import check_number
from exogym.backends.hosting import SERVER_ROLE
from exogym.cluster.network import Network
from exogym.cluster.simtime import TimeModel
from exogym.cluster.slowdowns import build_slowdowns
from exogym.data.loader_options import loader_options
from exogym.data.sharding import DatasetOrFactory
from exogym.engine.config import RunConfig
from exogym.engine.devices import DeviceLike, MemoryCap, memory_fraction, resolve_node_devices
from exogym.engine.plan import RunPlan
from exogym.fit.config import FitConfig
from exogym.fit.loggers import resolve_logger, run_name_of
from exogym.fit.nodes import RunData, build_run_data, check_node_memory, check_trainable
from exogym.fit.resume import ResumePoint, resume_point
from exogym.launch import BACKENDS, Launcher, choose_launcher
from exogym.launch.environment import Environment
from exogym.runs.fingerprint import run_fingerprint
from exogym.runs.folder import check_writable
from exogym.runs.loggers import Logger
from exogym.strategy.base import Strategy

__all__ = ["FitPlan", "CheckpointSpec", "build_plan", "run_config", "build_time_model", "keeps_one_replica",
           "DEFAULT_DEVICE_FLOPS"]

DEFAULT_DEVICE_FLOPS = 1e12  # a nominal sustained 1 TFLOP/s per node; pass device_flops for your hardware


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often a run saves: `root` None is the run folder's checkpoints/ (known once it is claimed)."""

    root: Path | None
    interval: int
    keep: int


@dataclass(frozen=True)
class FitPlan:
    """What a fit call will do, checked and built before anything is claimed, started or printed
    (exogym.fit.lifecycle.RunLifecycle does those), and never changed after: the run's name where a default one
    is claimed, and the checkpoints' folder under it, are the lifecycle's (known once the folder is claimed).

    Attributes:
        run: the plan the launcher's processes run (without checkpoints: the lifecycle adds them once the run
            folder is claimed).
        launcher: who runs it.
        config: the record's config, every setting but the run's name (the lifecycle adds it as the run opens:
            a default name is the one claimed).
        logger: the run's loggers (None: none, or not the main process).
        run_name: the run's explicit name (None: a default name is claimed).
        resumed: where the run starts.
        fingerprint: what a checkpoint of this run must match.
        checkpoints: where and how often it saves (None: it does not).
        checkpoint_dir: fit's checkpoint_dir (an ended run of the same name moves aside with it).
        default_checkpoints: the checkpoints go under logs/<run_name>/ (fit's checkpoint_dir was not given).
        overwrite: fit's overwrite.
        devices: each node's device.
        memory_cap: the device memory caps applied while the run runs.
        time_model: the simulated time's model, for the run's announcement.
        log_interval: every log_interval-th step's row goes to the loggers.
        is_main: this process holds the run folders and the loggers.
        show_progress: the announcement and the progress bar are shown.
    """

    run: RunPlan
    launcher: Launcher
    config: Mapping[str, Any]
    logger: Logger | None
    run_name: str | None
    resumed: ResumePoint
    fingerprint: dict[str, Any]
    checkpoints: CheckpointSpec | None
    checkpoint_dir: str | os.PathLike | None
    default_checkpoints: bool
    overwrite: bool
    devices: list[torch.device]
    memory_cap: MemoryCap
    time_model: TimeModel | None
    log_interval: int
    is_main: bool
    show_progress: bool


def build_plan(c: FitConfig, *, model: torch.nn.Module, train_dataset: DatasetOrFactory,
               val_dataset: DatasetOrFactory | None, device: DeviceLike | None,
               devices: Sequence[DeviceLike] | None, environment: Environment) -> FitPlan:
    """Validate the run against the model, the data and the machine, and build its plan.

    Args:
        c: the fit call's configuration.
        model: the Trainer's model (copied to every node, never modified).
        train_dataset: the Trainer's training data.
        val_dataset: its validation data, or None.
        device: the Trainer's default device (fit's device/devices win).
        devices: the Trainer's default per-node devices.
        environment: this process's place (alone, or one of torchrun's).

    Returns:
        The plan.

    Raises:
        ValueError: a setting that does not fit the model, the data, the machine or the launch.
        TypeError: a setting of the wrong type.
        CheckpointError: resume_from names a checkpoint of another run (every difference listed).
    """
    s, sim, ln, k = c.schedule, c.simulation, c.launch, c.checkpoint
    check_node_memory(c.num_nodes, environment=environment)  # the per-node overhead alone: 10**9 nodes, at once
    time_model = build_time_model(c.num_nodes, sim.network, sim.node_speeds, sim.device_flops, sim.compute_time,
                                  sim.slowdowns)
    if s.minibatch > s.batch_size or s.batch_size % s.minibatch:
        raise ValueError(f"minibatch_size must divide batch_size={s.batch_size}, got {s.minibatch}")
    logger = resolve_logger(c.logging.logger, c.logging.run_name)
    run_name = run_name_of(logger, c.logging.run_name)  # None: a default name is claimed as the run opens
    if ln.backend not in BACKENDS:
        raise ValueError(f"unknown backend {ln.backend!r}; use one of {list(BACKENDS)}")
    # Under torchrun backend="torch" runs only this process's node, backend="sim" this process's block of nodes;
    # rank 0 logs.
    # A strategy that sends messages has the server role (with the sim's one event queue), beside node 0.
    launcher = choose_launcher(environment, ln.backend, c.num_nodes, processes=ln.processes, port=ln.port,
                               checkpoint_dir_shared=k.checkpoint_interval is None or k.checkpoint_dir is not None
                               or run_name is not None,
                               roles=frozenset({SERVER_ROLE}) if c.strategy.sends_messages else frozenset())
    is_main = launcher.is_main
    logger = logger if is_main else None
    node_devices = launcher.node_devices(resolve_node_devices(
        c.num_nodes, ln.device if ln.device is not None or ln.devices is not None else device,
        ln.devices if ln.devices is not None or ln.device is not None else devices))
    if k.checkpoint_dir is not None:
        check_writable(k.checkpoint_dir, "checkpoint_dir")
    one_replica = keeps_one_replica(c.strategy)
    check_node_memory(c.num_nodes, model=model, one_replica=one_replica, devices=node_devices,
                      environment=environment)
    memory_cap = memory_fraction(ln.max_memory_usage, node_devices)
    loader = loader_options(c.data.dataloader_kwargs, node_devices)
    if s.autocast and any(d.type == "cuda" and not torch.cuda.is_bf16_supported() for d in node_devices):
        raise ValueError("autocast=True trains in bfloat16, which this GPU does not support; use autocast=False")
    data = build_run_data(c, train_dataset, val_dataset, loader)
    c.strategy.check_length(c.num_nodes, data.total_steps)
    c.strategy.check_data(data.node_batches, processes=launcher.processes)  # options that need the data's shape
    check_trainable(model)  # before the execution probe, which would build an optimizer of nothing
    cfg = RunConfig(num_nodes=c.num_nodes, max_steps=data.total_steps, batch_size=s.batch_size,
                    minibatch_size=s.minibatch, val_interval=s.val_interval,
                    log_interval=max(c.logging.log_interval, 10),  # the nodes' host syncs of the loss; loggers: below
                    autocast=s.autocast, validate=data.val_batches is not None,
                    diagnostics_interval=s.diagnostics_interval, time_model=time_model,
                    steps_per_epoch=data.steps_per_epoch, membership=data.membership,
                    shard_sizes=tuple(nb.shard_size for nb in data.node_batches),
                    shard_steps=tuple(nb.steps_per_epoch for nb in data.node_batches))
    # The backend says which execution its nodes run (the sim may batch them: its probe runs here).
    execution, execution_why = launcher.backend.execution(
        s.execution, model=model, first_batch=lambda: next(data.node_batches[0].iterate(from_step=0)),
        num_nodes=c.num_nodes, devices=node_devices, minibatch_size=s.minibatch,
        autocast=s.autocast, seed=s.seed, resume_from=k.resume_from,
        optim_spec=getattr(c.strategy, "optim_spec", None), one_replica=one_replica)
    processes = launcher.processes if ln.backend == "sim" else ln.processes
    config = run_config(c, model=model, data=data, time_model=time_model, devices=node_devices, loader=loader,
                        execution=(execution, execution_why))
    fingerprint = run_fingerprint(config, model, [nb.shard_size for nb in data.node_batches])
    config["processes"] = processes  # where the run runs, not what it computes: outside the fingerprint
    resumed = resume_point(k.resume_from, fingerprint, node_devices, run_name=run_name, extend=k.extend_run,
                           max_steps=data.total_steps)
    if resumed.record is not None:
        config["resumed"] = resumed.record
    checkpoints = None
    if k.saves:  # a folder alone: one checkpoint, at the end
        checkpoints = CheckpointSpec(Path(k.checkpoint_dir) if k.checkpoint_dir is not None else None,
                                     k.checkpoint_interval or data.total_steps, k.keep_checkpoints)
    run = RunPlan(model=model, strategy=c.strategy, node_batches=data.node_batches, val_batches=data.val_batches,
                  devices=node_devices, cfg=cfg, seed=s.seed, resume=resumed.states, node_timeout=ln.node_timeout,
                  peer_timeout=ln.peer_timeout, execution=execution)
    return FitPlan(run=run, launcher=launcher, config=MappingProxyType(config), logger=logger, run_name=run_name, resumed=resumed,
                   fingerprint=fingerprint, checkpoints=checkpoints, checkpoint_dir=k.checkpoint_dir,
                   default_checkpoints=k.checkpoint_dir is None and k.checkpoint_interval is not None,
                   overwrite=c.logging.overwrite, devices=node_devices, memory_cap=memory_cap, time_model=time_model,
                   log_interval=c.logging.log_interval,
                   is_main=is_main,
                   show_progress=c.logging.progress and is_main)


def keeps_one_replica(strategy: Strategy) -> bool:
    """Whether sequential nodes of this strategy share one replica (DDP's one_replica): they then take one
    optimizer step per step between them, which execution="auto" must compare against."""
    return bool(getattr(type(strategy), "one_replica", False))


def run_config(c: FitConfig, *, model: torch.nn.Module, data: RunData, time_model: Any,
               devices: list[torch.device], loader: dict[str, Any], execution: tuple[str, str]) -> dict[str, Any]:
    """The run's config.json: every setting that shapes it, given or derived; the settings that had no effect are
    listed apart, under "ignored" (name -> value and why)."""
    s, sim = c.schedule, c.simulation
    ignored = dict(c.ignored)
    ignored.update({f"strategy.{k}": v for k, v in c.strategy.ignored_settings.items()})
    if s.max_steps is not None and s.num_epochs != 1:  # 1: fit's default, not a setting
        ignored["num_epochs"] = {"value": s.num_epochs, "reason": f"max_steps={s.max_steps} sets the run's length"}
    config = {"strategy": type(c.strategy).__name__, "strategy_config": c.strategy.config(),
              "num_nodes": c.num_nodes, "max_steps": data.total_steps, "steps_per_epoch": data.steps_per_epoch,
              **({} if "num_epochs" in ignored else {"num_epochs": s.num_epochs}), "batch_size": s.batch_size,
              "minibatch_size": s.minibatch, "global_batch": c.num_nodes * s.batch_size, "shuffle": s.shuffle,
              "val_size": data.val_size if data.val_batches else 0, "val_interval": s.val_interval,
              "log_interval": c.logging.log_interval, "seed": s.seed, "backend": c.launch.backend,
              "autocast": s.autocast,
              "execution": execution[0], "execution_reason": execution[1], "devices": [str(d) for d in devices],
              "model": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
              "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "versions": versions()}
    if ignored:
        config["ignored"] = ignored
    if c.data.dataloader_kwargs is not None:
        config["dataloader_kwargs"] = {"given": dict(c.data.dataloader_kwargs), "applied": loader}
    if c.launch.max_memory_usage is not None:
        config["max_memory_usage"] = c.launch.max_memory_usage
    if c.launch.port is not None:
        config["port"] = c.launch.port
    if c.logging.extra_config is not None:
        config["extra"] = dict(c.logging.extra_config)
    if data.split is not None:
        config["partition"] = {"kind": c.data.partition, **data.split.settings, "sizes": data.split.sizes,
                               "label_histograms": data.split.label_histograms()}
    if data.membership is not None:
        config["membership"] = {"failures": repr(sim.failures), "active_nodes": repr(sim.active_nodes),
                                "schedule": data.membership.as_record()}
    if time_model is not None:
        config["time_model"] = {"network": repr(time_model.network), "node_speeds": list(time_model.node_speeds),
                                "device_flops": list(time_model.device_flops), "compute_time": sim.compute_time}
        if time_model.slowdowns is not None:  # only then: the fingerprint of a run without them stays as it was
            config["time_model"]["slowdowns"] = time_model.slowdowns.describe()
    return config


def build_time_model(num_nodes: int, network: Any, node_speeds: Any, device_flops: Any,
                     compute_time: str, slowdowns: Any = None) -> TimeModel | None:
    """The simulated time's model (None: no simulated time): a network, per-node speeds and FLOP rates, and the
    transient slowdowns (exogym.cluster.slowdowns)."""
    if compute_time not in ("flops", "measured"):
        raise ValueError(f"compute_time must be 'flops' or 'measured', got {compute_time!r}")
    schedule = build_slowdowns(num_nodes, slowdowns)
    if network is None and node_speeds is None and device_flops is None and compute_time == "flops" \
            and schedule is None:
        return None
    if network is None:
        network = Network.preset("ideal")
    elif isinstance(network, str):
        network = Network.preset(network)
    elif not isinstance(network, Network):
        raise TypeError(f"network must be an exogym.cluster.network.Network or a preset name, got {network!r}")
    network.check_nodes(num_nodes)
    speeds = _per_node("node_speeds", node_speeds, 1.0, num_nodes)
    for i, v in enumerate(speeds):  # a node a million times slower or faster than the device means nothing more
        if not SPEED_RANGE[0] <= v <= SPEED_RANGE[1]:
            raise ValueError(f"node_speeds[{i}] must be between {SPEED_RANGE[0]:g} and {SPEED_RANGE[1]:g} (a node's "
                             f"speed relative to its device: 0.5 computes half as fast), got {v!r}")
    flops = _per_node("device_flops", device_flops, DEFAULT_DEVICE_FLOPS, num_nodes)
    return TimeModel(network, speeds, flops, measured=compute_time == "measured", slowdowns=schedule)


SPEED_RANGE = (1e-6, 1e6)  # node_speeds: beyond it simulated times overflow or lose every digit of a step


def _per_node(name: str, value: Any, default: float, num_nodes: int) -> tuple[float, ...]:
    values = [default] * num_nodes if value is None else [value] * num_nodes if isinstance(value, (int, float)) \
        else list(value)
    if len(values) != num_nodes:
        raise ValueError(f"{name} needs one value per node (num_nodes={num_nodes}), got {len(values)}")
    for i, v in enumerate(values):
        check_number(f"{name}[{i}]", v, positive=True, finite=True)
    return tuple(float(v) for v in values)


def versions() -> dict[str, str]:
    """The versions a run's record names."""
    import platform

    import exogym
    return {"exogym": exogym.__version__, "torch": torch.__version__, "python": platform.python_version()}
