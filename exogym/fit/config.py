"""A fit call's configuration, typed and frozen: fit's keyword arguments in sections (schedule, data, checkpoint,
simulation, launch, logging), checked once, as they are built, with nothing but the arguments themselves.

`Trainer.fit` keeps its signature (each keyword visible in help(), documented there); `FitConfig.from_arguments`
takes its keywords by name. What needs the model, the data or the machine is checked as the plan is built
(exogym.fit.plan).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from exogym._validation import MAX_SEED, check_int, check_number
from exogym.backends.peer_watch import BEAT_S, MIN_PEER_TIMEOUT
from exogym.cluster.membership import RandomFailures
from exogym.cluster.network import Network
from exogym.cluster.slowdowns import RandomSlowdowns
from exogym.engine.devices import DeviceLike
from exogym.engine.execution import EXECUTIONS
from exogym.runs.loggers import Logger
from exogym.strategy.base import Strategy

__all__ = ["FitConfig", "ScheduleConfig", "DataConfig", "CheckpointConfig", "SimulationConfig", "LaunchConfig",
           "LoggingConfig"]


@dataclass(frozen=True)
class ScheduleConfig:
    """How long the run trains and on what batches (fit's keywords of the same names)."""

    num_epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 16
    minibatch_size: int | None = None
    shuffle: bool = True
    val_size: int = 64
    val_interval: int = 100
    autocast: bool = False
    seed: int = 42
    diagnostics_interval: int | None = None
    execution: str = "sequential"

    @property
    def minibatch(self) -> int:
        """The minibatch size: minibatch_size, or the whole batch."""
        return self.batch_size if self.minibatch_size is None else self.minibatch_size


@dataclass(frozen=True)
class DataConfig:
    """How the training data is split over the nodes and loaded (fit's keywords of the same names)."""

    partition: str = "iid"
    dirichlet_alpha: float | None = None
    shards_per_node: int | None = None
    dataloader_kwargs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the run saves, and what it resumes (fit's keywords of the same names)."""

    checkpoint_interval: int | None = None
    checkpoint_dir: str | os.PathLike | None = None
    keep_checkpoints: int = 3
    resume_from: str | os.PathLike | None = None
    extend_run: bool = False

    @property
    def saves(self) -> bool:
        """Whether the run saves checkpoints (a folder alone: one, at the end)."""
        return self.checkpoint_interval is not None or self.checkpoint_dir is not None


@dataclass(frozen=True)
class SimulationConfig:
    """The simulated cluster: network, node speeds, compute time, failures, an elastic pool, transient slowdowns."""

    network: Network | str | None = None
    node_speeds: Sequence[float] | None = None
    device_flops: float | Sequence[float] | None = None
    compute_time: str = "flops"
    failures: Sequence[tuple[int, int, int | None]] | RandomFailures | None = None
    active_nodes: str | Sequence[tuple[int, int]] | Callable[[int], int] | None = None
    slowdowns: Sequence[tuple[int, float, float, float]] | RandomSlowdowns | None = None


@dataclass(frozen=True)
class LaunchConfig:
    """What runs the nodes and where: backend, processes, rendezvous port, devices, timeouts, memory caps."""

    backend: str = "sim"
    processes: int = 1
    port: int | None = None
    device: DeviceLike | None = None
    devices: Sequence[DeviceLike] | None = None
    node_timeout: float | None = None
    peer_timeout: float | None = None
    max_memory_usage: float | None = None


@dataclass(frozen=True)
class LoggingConfig:
    """What the run records and where: log interval, progress, loggers, run name, extra config."""

    log_interval: int = 1
    progress: bool = True
    logger: Logger | Sequence[Logger] | bool | None = None
    run_name: str | None = None
    overwrite: bool = False
    extra_config: Mapping[str, Any] | None = None


_SECTIONS = {"schedule": ScheduleConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
             "simulation": SimulationConfig, "launch": LaunchConfig, "logging": LoggingConfig}


@dataclass(frozen=True)
class FitConfig:
    """One fit call's configuration, checked once as it is built.

    Attributes:
        strategy: the strategy every node runs a copy of.
        num_nodes: how many nodes.
        schedule, data, checkpoint, simulation, launch, logging: fit's other keywords, by section.
        ignored: settings given to this call that had no effect (name -> {"value", "reason"}), which config.json
            lists apart.
    """

    strategy: Strategy
    num_nodes: int
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ignored: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], *,
                       ignored: Mapping[str, Mapping[str, Any]] | None = None) -> "FitConfig":
        """fit's keyword arguments, by name, in their sections.

        Args:
            arguments: every keyword of Trainer.fit (strategy, num_nodes and the rest), by name.
            ignored: the settings an adapter of this call noted as having no effect.

        Returns:
            The configuration, checked.

        Raises:
            TypeError: an argument of the wrong type, or a keyword fit does not have.
            ValueError: an argument out of its range, or arguments that contradict each other.
        """
        left = dict(arguments)
        sections = {}
        for name, section in _SECTIONS.items():
            names = [f.name for f in dataclasses.fields(section)]
            sections[name] = section(**{k: left.pop(k) for k in names if k in left})
        strategy, num_nodes = left.pop("strategy"), left.pop("num_nodes")
        if left:
            raise TypeError(f"fit() got unexpected keyword arguments {sorted(left)}")
        return cls(strategy, num_nodes, **sections, ignored=dict(ignored or {}))


def _check(c: FitConfig) -> None:
    """The checks that need nothing but the arguments themselves, in the order fit lists them."""
    s, k, lg, ln = c.schedule, c.checkpoint, c.logging, c.launch
    if not isinstance(c.strategy, Strategy):
        raise TypeError(f"strategy must be an exogym Strategy instance, got {c.strategy!r}")
    c.strategy.check_constructed()
    for name, value in (("num_nodes", c.num_nodes), ("num_epochs", s.num_epochs), ("batch_size", s.batch_size),
                        ("val_size", s.val_size), ("val_interval", s.val_interval), ("log_interval", lg.log_interval),
                        ("keep_checkpoints", k.keep_checkpoints)):
        check_int(name, value, minimum=1)
    c.strategy.check_nodes(c.num_nodes)
    check_int("seed", s.seed, minimum=0, maximum=MAX_SEED)
    for name, value in (("max_steps", s.max_steps), ("minibatch_size", s.minibatch_size),
                        ("checkpoint_interval", k.checkpoint_interval),
                        ("diagnostics_interval", s.diagnostics_interval), ("port", ln.port)):
        check_int(name, value, minimum=1, allow_none=True)
    if ln.port is not None and ln.port > 65535:
        raise ValueError(f"port must be a TCP port in 1..65535, got {ln.port}")
    if lg.extra_config is not None and not isinstance(lg.extra_config, dict):
        raise TypeError(f"extra_config (the original's fit(kwargs=...)) must be a dict, got {lg.extra_config!r}")
    for name, value in (("extend_run", k.extend_run), ("overwrite", lg.overwrite)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if k.extend_run and k.resume_from is None:
        raise TypeError("extend_run=True continues a checkpointed run past its planned length; it needs resume_from=")
    check_number("node_timeout", ln.node_timeout, positive=True, allow_none=True)
    if ln.node_timeout is not None and not math.isfinite(ln.node_timeout):
        raise ValueError(f"node_timeout must be a finite number of seconds or None (no limit), got {ln.node_timeout}")
    check_number("peer_timeout", ln.peer_timeout, allow_none=True, finite=True)
    if ln.peer_timeout is not None and ln.peer_timeout < MIN_PEER_TIMEOUT:
        raise ValueError(f"peer_timeout must be at least {MIN_PEER_TIMEOUT:g} s (five heartbeats of {BEAT_S:g} s: "
                         f"a beat delayed by a loaded machine is no lost process) or None (never), got "
                         f"{ln.peer_timeout!r}")
    if lg.overwrite and k.resume_from is not None:
        raise ValueError("overwrite=True would delete the run that resume_from continues; drop one of them")
    if s.execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {s.execution!r}")
    # processes=P: how many processes share the simulation (backend="sim"), each a block of nodes.
    check_int("processes", ln.processes, minimum=1)
    if ln.processes > 1 and ln.backend != "sim":
        raise ValueError(f"processes={ln.processes} spreads the sim backend's nodes over processes; "
                         f"backend={ln.backend!r} already runs one process per node: drop processes=")
    simulated_speeds = [name for name, value in (("node_speeds", c.simulation.node_speeds),
                                                 ("slowdowns", c.simulation.slowdowns)) if value is not None]
    if simulated_speeds and ln.backend == "torch" and c.strategy.sends_messages:
        given = "= and ".join(simulated_speeds)
        raise ValueError(
            f"{given}= cannot slow {type(c.strategy).__name__} on backend='torch': they stretch the simulated "
            "clock, and a strategy that sends messages runs on real time there (its messages, its server and "
            "time_budget_s go by the wall clock), so a slowed node would send as many updates, as early, as "
            "without them, while the record said it was slowed. Use backend='sim', where the simulated clock decides, "
            "or slow a node for real (a time.sleep in its step); the synchronous strategies take node_speeds and "
            "slowdowns on either backend")
    if ln.processes > c.num_nodes:
        raise ValueError(f"processes={ln.processes} is more than num_nodes={c.num_nodes}: each process simulates at "
                         f"least one node; use processes <= {c.num_nodes}")
