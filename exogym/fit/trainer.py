"""Trainer.fit: validate everything into a plan, open the run (exogym.fit.lifecycle), launch it (exogym.launch), return
the global model."""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from exogym._validation import check_int
from exogym.adapters import adaptable
from exogym.cluster.membership import RandomFailures
from exogym.cluster.slowdowns import RandomSlowdowns
from exogym.cluster.network import Network
from exogym.data.sharding import DatasetOrFactory, is_factory
from exogym.engine.devices import DeviceLike
from exogym.fit.config import FitConfig
from exogym.fit.plan import build_plan
from exogym.launch import BACKENDS as _BACKENDS, detect_environment
from exogym.fit.lifecycle import RunLifecycle
from exogym.runs.loggers import Logger
from exogym.runs.record import RunRecord
from exogym.strategy.base import Strategy

__all__ = ["Trainer", "LocalTrainer", "BACKENDS"]

BACKENDS = tuple(_BACKENDS)


class Trainer:
    """Holds the model and data; `fit` trains them with a strategy on `num_nodes` simulated nodes.

    Args:
        model: An `nn.Module` whose `model(batch)` returns a scalar loss, or a dict with `"loss"` and other
            scalar metrics. It is copied to every node and never modified; `fit` returns a new model.
        train_dataset: A map-style Dataset (sharded across nodes), or a factory
            `f(rank, num_nodes, is_val) -> Dataset` that builds each node's own.
        val_dataset: The same kinds as `train_dataset`, or None (no validation).
        start_port: The original EXO Gym's base rendezvous port: fit calls without `port=` on
            `backend="torch"` take `start_port`, `start_port + 1`, ... in turn (so back-to-back runs never wait
            on a port still closing).
        device: The default device of `fit` (see there).
        devices: The default devices of `fit` (see there).

    Raises:
        TypeError: `model` is not an `nn.Module`, a dataset is neither a Dataset nor a factory, or `start_port`
            is not an int.
        ValueError: `start_port` is below 1.

    Attributes:
        record: What the last `fit` measured (a `RunRecord`); None before the first.
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
            slowdowns: Sequence[tuple[int, float, float, float]] | RandomSlowdowns | None = None,
            node_timeout: float | None = 600.0, peer_timeout: float | None = 30.0,  # values, as the reference shows them
            dataloader_kwargs: dict[str, Any] | None = None,
            max_memory_usage: float | None = None, port: int | None = None,
            extra_config: dict[str, Any] | None = None, execution: str = "sequential",
            processes: int = 1, ignored_settings: dict[str, tuple[Any, str]] | None = None) -> torch.nn.Module:
        """Train with `strategy` on `num_nodes` nodes and return the global model (by default the nodes' average).

        The measurements land in `self.record` (a `RunRecord`) and go to `logger` every `log_interval` steps.
        Every argument is checked, and the run folder claimed, before any node starts. What each option does
        in practice, with examples: [the options of fit](../guide.md#the-options-of-fit),
        [logs and checkpoints](../guide.md#logs-plots-checkpoints-the-command-line),
        [simulated time](../guide.md#simulated-time) and [failures](../guide.md#failures-and-elastic-compute).

        Args:
            strategy: What each node does at each step and what it sends (an `exogym.strategy` Strategy).
            num_nodes: How many nodes train; 1 is plain training through the strategy.
            num_epochs: The run lasts this many passes over each node's shard, unless `max_steps` is given.
            max_steps: The run lasts this many optimizer steps (wins over `num_epochs`).
            batch_size: Examples per node per step; the global batch is `num_nodes x batch_size`.
            minibatch_size: Splits `batch_size` for gradient accumulation (must divide it; the same result as
                the full batch). Default: `batch_size`.
            shuffle: Shuffle each node's shard every epoch.
            val_size: Validation runs on these same examples every time.
            val_interval: Validation ("local": node 0's model, "global": the global model) runs every this many
                steps, at step 0 and at the end.
            autocast: Train in bfloat16 autocast.
            seed: Seeds every node's random streams (from `(seed, rank)`) and the data order.
            backend: `"sim"` (every node in this process) or `"torch"` (one process per node over
                torch.distributed).
            device: The device of every node; default: the Trainer's.
            devices: Node `r` runs on `devices[r % len(devices)]`; default: the Trainer's.
            log_interval: Every N-th step's row (and the last) goes to the loggers; `trainer.record` keeps
                every step.
            progress: Show a progress bar.
            logger: A Logger, a list of them, or False for none. Default: a CSVLogger writing
                `logs/<run_name>/` (`config.json`, `train.csv`, `val.csv`, `summary.json`).
            run_name: The run folder's name. The default (strategy, nodes, time) gets a `-2`, `-3`, ... suffix
                when taken; an explicit name (fit's, or the logger's) whose folder holds a run that has ended
                moves that run aside to `<name>.<when it started>` (`exogym.runs.rerun`; one still running is an
                error), unless `overwrite=True` or the run resumes from that run's own checkpoint: it then
                continues in the same folder, whose `train.csv` holds the whole run once. A run folder belongs to
                one run: it is claimed atomically before any node starts.
            overwrite: Reuse a taken run folder: that run's folder, and other runs' checkpoints in
                `checkpoint_dir`, are deleted.
            checkpoint_interval: Save every node's full state every N steps and at the end.
            checkpoint_dir: Where checkpoints go (default `logs/<run_name>/checkpoints`). Given without
                `checkpoint_interval`, one checkpoint is saved, at the end. Checked writable, like the log
                folder, before any node starts.
            keep_checkpoints: How many of this run's newest checkpoints are kept.
            resume_from: A checkpoint, a folder of them, or a run folder: continue exactly that run. The fit call
                must describe the same run (strategy and its settings, model, seed, data, nodes, schedule
                length), or a CheckpointError lists every difference before any node starts.
            extend_run: With `resume_from`, allow a larger `max_steps` (the LR schedule keeps its original
                length; the record's config says so).
            diagnostics_interval: Every N steps, record how far the nodes' parameters drift apart.
            network: A Network or a preset name (`"high"`, `"medium"`, `"low"`, `"home"`, `"ideal"`).
                This and the three below turn simulated time on: the record then has `sim_time_s` per step and
                compute/communication/waiting seconds per node.
            node_speeds: Per-node speed factors (0.5 = half as fast).
            device_flops: FLOP/s per node (one number, or one per node); default 1e12.
            compute_time: `"flops"`: each step's counted FLOPs over the node's throughput (deterministic);
                `"measured"`: its wall time.
            partition: How `train_dataset` is split: `"iid"`; `"dirichlet"` (by label, non-IID, with
                `dirichlet_alpha`); `"shards"` (sorted by label; each node gets `shards_per_node` of
                `num_nodes x shards_per_node` equal shards: the FedAvg paper's pathological non-IID split).
                The split's settings, shard sizes and label histograms go into the record's config.
            dirichlet_alpha: The concentration of `partition="dirichlet"`.
            shards_per_node: The shards each node gets under `partition="shards"` (default 2).
            failures: `[(node, step_down, step_up), ...]` (`step_up` None: never back) or
                `RandomFailures(rate, downtime, seed)`. A node that is down computes and sends nothing; the
                others' collectives run without it, and a node coming up first takes the global state from one
                that was up. Simulated: `backend="sim"` only (see `exogym.cluster.membership`).
            active_nodes: An elastic pool: `"doubling"`, `"halving"`, `"ramp_up"`, `"ramp_down"`,
                `[(from_step, count), ...]`, or a function `step -> count`; ranks `0..count-1` are in it.
                Simulated: `backend="sim"` only.
            slowdowns: Transient slowdowns in simulated time ("chaos"): `[(node, from_s, to_s, factor), ...]`
                (node computes `factor` times more slowly from simulated second `from_s` to `to_s`) or
                `RandomSlowdowns(rate, factor, duration, seed)` (drawn from the seed per node; see
                `exogym.cluster.slowdowns`). Turns simulated time on; the extra seconds are each node's
                `slowed_s`, and `record.slowdowns` lists the slowdowns that started while the nodes ran. On
                `backend="torch"` the synchronous strategies only (a strategy that sends messages runs on real time
                there, which simulated slowdowns cannot slow: a ValueError before any node starts).
            node_timeout: Seconds (default 600; None: no limit) a node may run without finishing a step or
                reaching a collective before it counts as stuck. The sim backend then stops the run with a
                NodeTimeoutError naming the node, its step and its Python stack; the torch backend uses it as
                the process group's timeout and names the node(s) that never reached the collective the
                others wait in (a gloo group's setup, as the processes start, waits at least 60 s).
            peer_timeout: Seconds (default 30, at least 5; None: never) a process of a run over several
                processes (`processes=P`, torchrun) may go without a heartbeat (one a second) before the others
                count it as lost: stopped, hung, or cut off by a network partition. A process waiting for it then
                raises a `PeerLostError` naming its rank and nodes, and the run ends as failed with every
                completed row kept. Apart from `node_timeout`, which bounds a node's own step.
            dataloader_kwargs: DataLoader options for how each node's batches are loaded (`num_workers`,
                `pin_memory`, `prefetch_factor`, `persistent_workers`, `timeout`, `worker_init_fn`,
                `multiprocessing_context`, `collate_fn`); the examples and their order stay exogym's
                (`exogym.data.loader_options`).
            max_memory_usage: Caps each GPU node's device at this fraction of its memory
                (`set_per_process_memory_fraction` of torch.cuda / torch.mps, reset after the run); rejected
                on a CPU, where torch has no such cap.
            port: The rendezvous port of `backend="torch"` when fit spawns the node processes (default: a free
                one the OS picks, or the Trainer's `start_port`); unused by the sim and under torchrun.
            extra_config: A dict recorded in `config.json` under `"extra"` (the original's `fit(kwargs=...)`).
            execution: `"sequential"` runs the nodes' forward/backward one after another; `"fused"` runs those
                of the nodes computing in a step as one batched (vmapped) computation (`backend="sim"`, one
                device; `exogym.backends.sim.fused`); `"auto"` probes both on throwaway copies and fuses only
                where that is faster.
            processes: P local processes share the simulation (`backend="sim"`), each running a contiguous
                block of the nodes (sizes differ by at most one) with torch's threads divided among them;
                collectives whose members sit in several processes cross between them over torch.distributed
                (gloo). Under torchrun with more than one process, `backend="sim"` runs this way on torchrun's
                processes. Bytes, simulated time, messages, the server and the global model's mean are
                exactly those of one process; a strategy's own sums are summed per process, then across
                processes, so they agree with one process to float rounding ([processes](../processes.md)).
            ignored_settings: Settings that had no effect, handed on by an adapter of the original's spellings
                (`exogym.adapters`): `{name: (value, why)}`, listed apart in `config.json` under `"ignored"`.

        Returns:
            The global model: a new module (the model given to the Trainer is never modified).

        Raises:
            TypeError: A misspelled keyword (naming the accepted ones) or an argument of the wrong type.
            ValueError: An argument out of range or inconsistent with another, before any node starts.
            RunFolderError: The run folder, or the checkpoint folder, holds a run still running (or one that
                ended without recording how, to be resumed) or files of no run.
            CheckpointError: `resume_from` describes a different run (every difference listed).
            DiskFullError: The checkpoint folder cannot hold one checkpoint, or a disk fills up during the run.
            NodeTimeoutError: A node is stuck longer than `node_timeout`.
            PeerLostError: Another process of the run went away, or stopped responding for `peer_timeout`.
            CollectiveError: Nodes misuse a collective (different ops, shapes or groups).
            NonFiniteLoss: A training or validation loss is nan or inf (naming where it first appeared).
            RunInterrupted: SIGTERM stopped the run (a KeyboardInterrupt; Ctrl-C raises KeyboardInterrupt).
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
