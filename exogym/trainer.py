"""Trainer.fit: validate everything into a plan, open the run (exogym.lifecycle), launch it (exogym.launch), return
the global model."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from exogym._validation import check_int
from exogym.adapters import adaptable
from exogym.backends.errors import DEFAULT_NODE_TIMEOUT
from exogym.cluster.membership import RandomFailures
from exogym.cluster.network import Network
from exogym.data.sharding import DatasetOrFactory, is_factory
from exogym.engine.devices import DeviceLike
from exogym.fit_config import FitConfig
from exogym.fit_plan import build_plan
from exogym.launch import BACKENDS as _BACKENDS, detect_environment
from exogym.lifecycle import RunLifecycle
from exogym.runs.loggers import Logger
from exogym.runs.record import RunRecord
from exogym.strategy.base import Strategy

__all__ = ["Trainer", "LocalTrainer", "BACKENDS"]

BACKENDS = tuple(_BACKENDS)


class Trainer:
    """Holds the model and data; `fit` trains them with a strategy on `num_nodes` simulated nodes.

    model: an nn.Module whose `model(batch)` returns a scalar loss, or a dict with "loss" and other
        scalar metrics. It is copied to every node and never modified; `fit` returns a new model.
    train_dataset / val_dataset: a map-style Dataset (sharded across nodes), or a factory
        f(rank, num_nodes, is_val) -> Dataset that builds each node's own. val_dataset may be None.
    device / devices: defaults for `fit` (see there).
    start_port: the original EXO Gym's base rendezvous port: fit calls without port= on backend="torch" take
        start_port, start_port + 1, ... in turn (so back-to-back runs never wait on a port still closing).
    """

    def __init__(self, model: torch.nn.Module, train_dataset: DatasetOrFactory,
                 val_dataset: DatasetOrFactory | None = None, start_port: int | None = None, *,
                 device: DeviceLike | None = None, devices: Sequence[DeviceLike] | None = None):
        check_int("start_port", start_port, minimum=1, allow_none=True)
        self._next_port = start_port
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, data in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if data is None and name == "val_dataset":
                continue
            if not (is_factory(data) or hasattr(data, "__getitem__")):
                raise TypeError(f"{name} must be a Dataset or a callable f(rank, num_nodes, is_val) -> Dataset, "
                                f"got {type(data).__name__}")
        self.model, self.train_dataset, self.val_dataset = model, train_dataset, val_dataset
        self.device, self.devices = device, devices
        self.record: RunRecord | None = None

    @adaptable
    def fit(self, strategy: Strategy, num_nodes: int = 1, *, num_epochs: int = 1, max_steps: int | None = None,
            batch_size: int = 16, minibatch_size: int | None = None, shuffle: bool = True, val_size: int = 64,
            val_interval: int = 100, autocast: bool = False, seed: int = 42, backend: str = "sim",
            device: DeviceLike | None = None, devices: Sequence[DeviceLike] | None = None,
            log_interval: int = 1, progress: bool = True, logger: Logger | Sequence[Logger] | bool | None = None,
            run_name: str | None = None, overwrite: bool = False, checkpoint_interval: int | None = None,
            checkpoint_dir: str | os.PathLike | None = None, keep_checkpoints: int = 3,
            resume_from: str | os.PathLike | None = None, extend_run: bool = False,
            diagnostics_interval: int | None = None,
            network: Network | str | None = None, node_speeds: Sequence[float] | None = None,
            device_flops: float | Sequence[float] | None = None, compute_time: str = "flops",
            partition: str = "iid", dirichlet_alpha: float | None = None, shards_per_node: int | None = None,
            failures: Sequence[tuple[int, int, int | None]] | RandomFailures | None = None,
            active_nodes: str | Sequence[tuple[int, int]] | Callable[[int], int] | None = None,
            node_timeout: float | None = DEFAULT_NODE_TIMEOUT, dataloader_kwargs: dict[str, Any] | None = None,
            max_memory_usage: float | None = None, port: int | None = None,
            extra_config: dict[str, Any] | None = None, execution: str = "sequential",
            processes: int = 1, ignored_settings: dict[str, tuple[Any, str]] | None = None) -> torch.nn.Module:
        """Train with `strategy` on `num_nodes` nodes; return the global model (by default the nodes' average).

        batch_size is per node (the global batch is num_nodes x batch_size); minibatch_size splits it
        for gradient accumulation. The run lasts max_steps optimizer steps, or num_epochs passes over
        each node's shard. Validation ("local": node 0's model, "global": the global model) runs on the
        same val_size examples every val_interval steps and at the end. The measurements land in
        `self.record`, and go to `logger` every log_interval steps: by default a CSVLogger writing
        logs/<run_name>/ (config.json, train.csv, val.csv, summary.json); False for none.
        A run folder belongs to one run: it is claimed atomically before any node starts. The default
        run_name (strategy, nodes, time) gets a -2, -3, ... suffix when taken; an explicit run_name (fit's, or
        the logger's) whose folder holds a run that has ended moves that run aside to <name>.<when it started>
        (exogym.runs.rerun; one still running is an error), unless overwrite=True (that run's folder, and other
        runs' checkpoints in checkpoint_dir, are deleted) or the run resumes from that run's own checkpoint: it
        then continues in the same folder, whose train.csv holds the whole run once.

        checkpoint_interval=N saves every node's full state every N steps and at the end into
        checkpoint_dir (default logs/<run_name>/checkpoints), keeping this run's newest keep_checkpoints;
        resume_from=<a checkpoint, a folder of them, or a run folder> continues exactly that run: the fit call
        must describe the same run (strategy and its settings, model, seed, data, nodes, schedule length), or a
        CheckpointError lists every difference before any node starts. extend_run=True allows a larger
        max_steps (the LR schedule keeps its original length; the record's config says so).
        diagnostics_interval=N records how far the nodes' parameters drift apart every N steps.
        checkpoint_dir and the log folder are checked writable before any node starts.

        node_timeout (seconds, default 600; None: no limit): a node that runs that long without finishing a
        step or reaching a collective is stuck. The sim backend stops the run with a NodeTimeoutError naming
        the node, its step and its Python stack; the torch backend uses it as the process group's timeout and
        names the node(s) that never reached the collective the others wait in.

        Simulated time (on when any of these is given): network (a Network or a preset name: "high",
        "medium", "low", "home", "ideal"), node_speeds (per-node factors, 0.5 = half as fast),
        device_flops (FLOP/s per node, default 1e12), compute_time ("flops": each step's counted
        FLOPs over the node's throughput, deterministic; "measured": its wall time). The record then
        has sim_time_s per step and compute/communication/waiting seconds per node.

        failures=[(node, step_down, step_up), ...] (step_up None: never back) or RandomFailures(rate, downtime,
        seed): a node that is down computes and sends nothing; the others' collectives run without it, and
        a node coming up first takes the global state from one that was up. active_nodes: an elastic pool
        ("doubling", "halving", "ramp_up", "ramp_down", [(from_step, count), ...], or step -> count; ranks
        0..count-1 are in it). Both are simulated: backend="sim" only (see exogym.cluster.membership).

        processes=P (sim backend): P local processes share the simulation, each running a contiguous block of
        the nodes (sizes differ by at most one) with torch's threads divided among them; collectives whose members
        sit in several processes cross between them over torch.distributed (gloo). Under torchrun with more than
        one process, backend="sim" runs this way on torchrun's processes. Results agree with one process to float
        rounding (only sums across processes reassociate); bytes and simulated time are exactly those of one.

        execution: "sequential" runs the nodes' forward/backward one after another; "fused" runs those of
        the nodes computing in a step as one batched (vmapped) computation (backend="sim", one device;
        exogym.backends.sim.fused); "auto" probes both on throwaway copies and fuses only where that is faster.

        partition="dirichlet" with dirichlet_alpha splits a labelled train_dataset by label (non-IID);
        partition="shards" sorts it by label and deals each node shards_per_node (default 2) of
        num_nodes x shards_per_node equal shards (the FedAvg paper's pathological non-IID split).
        The split's settings, shard sizes and label histograms go into the record's config.

        num_nodes defaults to 1 (one node: plain training through the strategy). checkpoint_dir without
        checkpoint_interval saves one checkpoint, at the end. log_interval=N sends every N-th step's row (and
        the last) to the loggers; trainer.record keeps every step. dataloader_kwargs: DataLoader options for how
        each node's batches are loaded (num_workers, pin_memory, prefetch_factor, persistent_workers, timeout,
        worker_init_fn, multiprocessing_context, collate_fn); the examples and their order stay exogym's
        (exogym.data.loader_options). max_memory_usage=f caps each GPU node's device at that fraction of its
        memory (torch.cuda / torch.mps set_per_process_memory_fraction, reset after the run); on a CPU it is
        rejected, as torch has no such cap there. port: the rendezvous port of backend="torch" when fit
        spawns the node processes (default: a free one the OS picks); unused by the sim and under torchrun.
        extra_config: a dict recorded in config.json under "extra" (the original's fit(kwargs=...)).
        """
        arguments = {k: v for k, v in locals().items() if k not in ("self", "ignored_settings")}
        # What the argument adapters of this call dropped as having no effect: config.json lists it apart.
        ignored = {k: {"value": v, "reason": why} for k, (v, why) in (ignored_settings or {}).items()}
        if port is None and self._next_port is not None:  # the original's start_port: one port per fit call
            arguments["port"], self._next_port = self._next_port, self._next_port + 1
        config = FitConfig.from_arguments(arguments, ignored=ignored)
        # Everything that can be checked is, before any node starts; nothing is claimed or started yet.
        plan = build_plan(config, model=self.model, train_dataset=self.train_dataset, val_dataset=self.val_dataset,
                          device=self.device, devices=self.devices, environment=detect_environment())
        run = RunLifecycle(plan)
        run.open()
        try:
            results = run.launch()
        finally:
            self.record = run.record  # what the nodes trained, also when they stopped part-way
        model = run.complete(results)
        self.record = run.record
        return model


LocalTrainer = Trainer
