"""Trainer.fit: validate everything, assemble the nodes, run them on a backend, return the global model."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from exogym._validation import check_int
from exogym.adapters import adaptable
from exogym.backends.errors import DEFAULT_NODE_TIMEOUT
from exogym.backends.sim import run_sim
from exogym.backends.sim.processes import run_sim_launched, run_sim_processes
from exogym.backends.sim.fused.choose import choose_execution
from exogym.backends.torch.launch import launch_for_fit, run_torch
from exogym.cluster.membership import RandomFailures, build_membership
from exogym.cluster.network import Network
from exogym.data.loader_options import loader_options
from exogym.data.sharding import DatasetOrFactory, is_factory
from exogym.engine.config import RunConfig
from exogym.engine.devices import DeviceLike, memory_fraction, resolve_node_devices
from exogym.engine.plan import RunPlan
from exogym.engine.rng import GlobalRNGState
from exogym.fit_end import ending, interrupt_on_sigterm, trace_non_finite
from exogym.fit_plan import (FitArguments, FitRun as _Run, RunData, check_arguments, check_processes,
                             keeps_one_replica, resume_point, run_config)
from exogym.fit_setup import (announce, build_node_batches, build_time_model, build_val_batches, check_node_memory,
                              check_trainable, claim_run_folders, partition_data, peak_memory_mb, resolve_logger,
                              run_name_of)
from exogym.runs.checkpoint import CheckpointPlan, check_checkpoint_space
from exogym.runs.fingerprint import run_fingerprint
from exogym.runs.folder import check_writable
from exogym.runs.loggers import Logger, default_run_name
from exogym.runs.progress import RunProgress
from exogym.runs.record import LiveLog, RunRecord
from exogym.strategy.base import Strategy

__all__ = ["Trainer", "LocalTrainer", "BACKENDS"]

_RUNNERS = {"sim": run_sim, "torch": run_torch}
BACKENDS = tuple(_RUNNERS)


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
        o = FitArguments(**{k: v for k, v in locals().items() if k != "self"})
        if o.port is None and self._next_port is not None:  # the original's start_port: one port per fit call
            o.port, self._next_port = self._next_port, self._next_port + 1
        check_arguments(o)
        check_processes(o)
        run = self._plan(o)  # everything that can be checked is, before any node starts
        results = self._run(run)
        return self._finish(run, results)

    def _plan(self, o: FitArguments) -> _Run:
        """Validate the run against the model and data, build every node's data, the record's config, the run
        folder and the plan a backend starts."""
        time_model = build_time_model(o.num_nodes, o.network, o.node_speeds, o.device_flops, o.compute_time)
        minibatch_size = o.batch_size if o.minibatch_size is None else o.minibatch_size
        if minibatch_size > o.batch_size or o.batch_size % minibatch_size:
            raise ValueError(f"minibatch_size must divide batch_size={o.batch_size}, got {minibatch_size}")
        logger = resolve_logger(o.logger, o.run_name)
        run_name = run_name_of(logger, o.run_name)  # None: a default name is claimed below
        if o.backend not in BACKENDS:
            raise ValueError(f"unknown backend {o.backend!r}; use one of {list(BACKENDS)}")
        # Under torchrun (RANK, WORLD_SIZE set) backend="torch" runs only this process's node, backend="sim" this
        # process's block of nodes; rank 0 logs.
        launch = launch_for_fit(o.backend, o.num_nodes, processes=o.processes,
                                checkpoint_dir_shared=o.checkpoint_interval is None or o.checkpoint_dir is not None
                                or run_name is not None)
        is_main = launch is None or launch.rank == 0
        logger = logger if is_main else None
        devices = self._node_devices(o, launch)
        check_node_memory(o.num_nodes, model=self.model, one_replica=keeps_one_replica(o.strategy), devices=devices)
        memory_cap = memory_fraction(o.max_memory_usage, devices)
        loader = loader_options(o.dataloader_kwargs, devices)
        if o.autocast and any(d.type == "cuda" and not torch.cuda.is_bf16_supported() for d in devices):
            raise ValueError("autocast=True trains in bfloat16, which this GPU does not support; use autocast=False")
        data = self._data(o, loader)
        check_trainable(self.model)  # before the execution probe, which would build an optimizer of nothing
        cfg = RunConfig(num_nodes=o.num_nodes, max_steps=data.total_steps, batch_size=o.batch_size,
                        minibatch_size=minibatch_size, val_interval=o.val_interval,
                        log_interval=max(o.log_interval, 10),  # the nodes' host syncs of the loss; loggers: below
                        autocast=o.autocast, validate=data.val_batches is not None,
                        diagnostics_interval=o.diagnostics_interval, time_model=time_model,
                        steps_per_epoch=data.steps_per_epoch, membership=data.membership,
                        shard_sizes=tuple(nb.shard_size for nb in data.node_batches),
                        shard_steps=tuple(nb.steps_per_epoch for nb in data.node_batches))
        execution, execution_why = choose_execution(
            o.execution, model=self.model, first_batch=lambda: next(data.node_batches[0].iterate(from_step=0)),
            num_nodes=o.num_nodes, devices=devices, backend=o.backend, minibatch_size=minibatch_size,
            autocast=o.autocast, seed=o.seed, resume_from=o.resume_from,
            optim_spec=getattr(o.strategy, "optim_spec", None), one_replica=keeps_one_replica(o.strategy))
        config = run_config(o, model=self.model, data=data, time_model=time_model, devices=devices, loader=loader,
                            execution=(execution, execution_why))
        if o.progress and is_main:
            announce(config, time_model)
        fingerprint = run_fingerprint(config, self.model, [nb.shard_size for nb in data.node_batches])
        resumed = resume_point(o.resume_from, fingerprint, devices, run_name=run_name, extend=o.extend_run,
                               max_steps=data.total_steps, announce=o.progress and is_main)
        if resumed.record is not None:
            config["resumed"] = resumed.record
        # The run folder(s), claimed last: everything that can be checked before any node starts has been.
        default_ckpt = o.checkpoint_dir is None and o.checkpoint_interval is not None
        claim = claim_run_folders(logger, resumed.run_name if resumed.run_name is not None else run_name,
                                  default_run_name({"strategy": type(o.strategy).__name__, "num_nodes": o.num_nodes}),
                                  extra_roots=["logs"] if default_ckpt and is_main else [], overwrite=o.overwrite,
                                  resume_after=resumed.after, checkpoint_dir=o.checkpoint_dir) if is_main else None
        run_name = claim.name if claim is not None else resumed.run_name or run_name or default_run_name(config)
        config["run_name"] = run_name
        run = _Run(config=config, logger=logger, claim=claim, memory_cap=memory_cap, devices=devices)
        try:
            checkpoints = None
            if o.checkpoint_interval is not None or o.checkpoint_dir is not None:  # a folder alone: one, at the end
                root = Path(o.checkpoint_dir) if o.checkpoint_dir is not None else Path("logs") / run_name / "checkpoints"
                checkpoints = CheckpointPlan(check_writable(root, "checkpoint_dir"),
                                             o.checkpoint_interval or data.total_steps, o.keep_checkpoints, config,
                                             resumed.run_id, fingerprint)
                if is_main:  # the process claiming the run folders holds the checkpoint folder for the run
                    check_checkpoint_space(checkpoints.root, self.model, o.num_nodes)
                    run.claim = checkpoints.check_owner(overwrite=o.overwrite, claim=run.claim)
            run.bar = RunProgress(data.total_steps, initial=resumed.step) if o.progress and is_main else None
            live = LiveLog(logger, [launch.rank] if launch is not None and o.backend == "torch" else range(o.num_nodes),
                           global_batch=o.num_nodes * o.batch_size, log_interval=o.log_interval,
                           last_step=data.total_steps, progress=run.bar)
            if resumed.states is not None:
                live.add_resumed([state.log for state in resumed.states])  # the run's steps before its checkpoint
            run.plan = RunPlan(model=self.model, strategy=o.strategy, node_batches=data.node_batches,
                               val_batches=data.val_batches, devices=devices, cfg=cfg, seed=o.seed, live=live,
                               checkpoints=checkpoints, resume=resumed.states, node_timeout=o.node_timeout,
                               port=o.port, execution=execution,
                               on_stuck=run.fail)  # a node stuck in native code: the folder says so, then exit
            run.runner = _runner(o.backend, launch, o.processes)
            config["processes"] = launch.world_size if launch is not None and o.backend == "sim" else o.processes
            if logger is not None:
                logger.start(config)
        except BaseException:
            run.abandon()
            raise
        return run

    def _node_devices(self, o: FitArguments, launch: Any) -> list[torch.device]:
        """Each node's device (fit's device/devices, else the Trainer's); checkpoint_dir checked writable."""
        devices = resolve_node_devices(
            o.num_nodes, o.device if o.device is not None or o.devices is not None else self.device,
            o.devices if o.devices is not None or o.device is not None else self.devices)
        if launch is not None:
            devices = launch.node_devices(devices)
        if o.checkpoint_dir is not None:
            check_writable(o.checkpoint_dir, "checkpoint_dir")
        return devices

    def _data(self, o: FitArguments, loader: dict[str, Any]) -> RunData:
        """Every node's batches, the fixed validation batches and who is up when, checked before any node starts."""
        split = partition_data(self.train_dataset, o.partition, o.dirichlet_alpha, o.num_nodes, o.batch_size, o.seed,
                               shards_per_node=o.shards_per_node)
        node_batches = build_node_batches(self.train_dataset, split, num_nodes=o.num_nodes, batch_size=o.batch_size,
                                          shuffle=o.shuffle, seed=o.seed, loader=loader)
        steps_per_epoch = min(nb.steps_per_epoch for nb in node_batches)
        total_steps = o.max_steps if o.max_steps is not None else o.num_epochs * steps_per_epoch
        val_batches, val_size = build_val_batches(self.val_dataset, num_nodes=o.num_nodes, val_size=o.val_size,
                                                  batch_size=o.batch_size, seed=o.seed,
                                                  collate_fn=loader.get("collate_fn"))
        membership = build_membership(o.num_nodes, total_steps, o.failures, o.active_nodes)
        if membership is not None:
            if o.backend != "sim":
                raise ValueError(f"failures and active_nodes are simulated by backend='sim'; on backend={o.backend!r} "
                                 "the nodes are real processes that do not fail on a schedule")
            if not o.strategy.supports_membership_changes:
                raise ValueError(f"{type(o.strategy).__name__} cannot run with failures or active_nodes (see its "
                                 "docstring); drop them or use another strategy")
        return RunData(split, node_batches, steps_per_epoch, total_steps, val_batches, val_size, membership)

    def _run(self, run: _Run) -> list[Any]:
        """Start the nodes on the backend; the caller's random streams and memory caps are put back after."""
        run.started = time.perf_counter()
        caller_rng = GlobalRNGState.capture()  # the caller's random streams are theirs: put them back after
        try:
            with interrupt_on_sigterm():
                run.memory_cap.apply()
                return run.runner(run.plan)
        except BaseException as e:
            error = trace_non_finite(e, run.plan.live.partial_logs())
            self.record = run.fail(error)  # what the nodes trained, also on the exception
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__ keeps its own form
                error.record, error.run_folder = self.record, run.folder
            if isinstance(error, KeyboardInterrupt):
                _note_interrupted(error, run, len(self.record.train) if self.record is not None else 0)
            if error is e:
                raise
            raise error from None
        finally:
            caller_rng.restore()
            run.memory_cap.reset()

    def _finish(self, run: _Run, results: list[Any]) -> torch.nn.Module:
        """The record of the run (also to the loggers and the run folder), and the global model as a new module."""
        logs, final_state = [log for log, _ in results], results[0][1]
        config = run.config
        self.record = RunRecord.from_nodes(logs, config=config, global_batch=config["global_batch"],
                                           wall_time_s=time.perf_counter() - run.started,
                                           peak_memory_mb=peak_memory_mb(run.devices))
        if run.bar is not None:
            run.bar.close(self.record.summary())
        if run.logger is not None:
            run.logger.finish({"status": "completed", **self.record.summary()})
        if run.claim is not None:
            run.claim.release("completed")
        final_model = copy.deepcopy(self.model).to(run.devices[0])
        final_model.load_state_dict(final_state, strict=True)
        return final_model


def _note_interrupted(error: BaseException, run: _Run, steps: int) -> None:
    """Say where an interrupted run stands and how to continue it."""
    checkpoints = run.plan.checkpoints if run.plan is not None else None
    newest = ending(error, checkpoints.root if checkpoints is not None else None)["resume_from"]
    how = (f"continue it with fit(..., resume_from={newest!r})" if newest is not None else
           "it had no checkpoint to resume from (fit's checkpoint_interval saves them)")
    where = f" (run folder {run.folder})" if run.folder else ""
    if hasattr(error, "add_note"):
        error.add_note(f"exogym: the run was interrupted after {steps} trained step(s){where}; {how}")


def _runner(backend: str, launch: Any, processes: int) -> Callable[[RunPlan], list[Any]]:
    """What starts the nodes: the sim in this process, over several (fit's processes, or torchrun's), or torch's."""
    if backend == "sim" and launch is not None:
        return lambda plan: run_sim_launched(plan, launch.rank, launch.world_size)
    if backend == "sim" and processes > 1:
        return lambda plan: run_sim_processes(plan, processes)
    return _RUNNERS[backend]


LocalTrainer = Trainer
