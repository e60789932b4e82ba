"""Trainer.fit: validate everything, assemble the nodes, run them on a backend, return the global model."""

from __future__ import annotations

import copy
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from exogym._validation import check_int, check_number
from exogym.adapters import adaptable
from exogym.backends.sim import run_sim
from exogym.backends.errors import DEFAULT_NODE_TIMEOUT
from exogym.backends.torch.launch import launch_for_fit, run_torch
from exogym.runs.checkpoint import CheckpointPlan, check_resume, find_checkpoint, load_checkpoint, read_manifest
from exogym.data.loader_options import loader_options
from exogym.data.sharding import DatasetOrFactory, is_factory
from exogym.engine.devices import DeviceLike, memory_fraction, resolve_node_devices
from exogym.backends.sim.fused.choose import EXECUTIONS, choose_execution
from exogym.fit_setup import (announce, build_node_batches, build_time_model, build_val_batches, claim_run_folders,
                              partition_data, peak_memory_mb, resolve_logger, run_name_of, versions)
from exogym.runs.loggers import Logger, default_run_name
from exogym.runs.fingerprint import run_fingerprint
from exogym.cluster.membership import RandomFailures, build_membership
from exogym.cluster.network import Network
from exogym.engine.config import RunConfig
from exogym.engine.plan import RunPlan
from exogym.runs.progress import RunProgress
from exogym.runs.record import LiveLog, RunRecord
from exogym.engine.rng import GlobalRNGState
from exogym.runs.folder import check_writable
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
            extra_config: dict[str, Any] | None = None, execution: str = "sequential") -> torch.nn.Module:
        """Train with `strategy` on `num_nodes` nodes; return the global model (by default the nodes' average).

        batch_size is per node (the global batch is num_nodes x batch_size); minibatch_size splits it
        for gradient accumulation. The run lasts max_steps optimizer steps, or num_epochs passes over
        each node's shard. Validation ("local": node 0's model, "global": the global model) runs on the
        same val_size examples every val_interval steps and at the end. The measurements land in
        `self.record`, and go to `logger` every log_interval steps: by default a CSVLogger writing
        logs/<run_name>/ (config.json, train.csv, val.csv, summary.json); False for none.
        A run folder belongs to one run: it is claimed atomically before any node starts. The default
        run_name (strategy, nodes, time) gets a -2, -3, ... suffix when taken; an explicit run_name (fit's, or
        the logger's) whose folder holds a run is an error, unless overwrite=True (that run's folder, and other
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
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be an exogym Strategy instance, got {strategy!r}")
        strategy.check_constructed()
        check_int("num_nodes", num_nodes, minimum=1)
        check_int("num_epochs", num_epochs, minimum=1)
        check_int("max_steps", max_steps, minimum=1, allow_none=True)
        check_int("batch_size", batch_size, minimum=1)
        check_int("minibatch_size", minibatch_size, minimum=1, allow_none=True)
        check_int("val_size", val_size, minimum=1)
        check_int("val_interval", val_interval, minimum=1)
        check_int("log_interval", log_interval, minimum=1)
        check_int("seed", seed, minimum=0)
        check_int("checkpoint_interval", checkpoint_interval, minimum=1, allow_none=True)
        check_int("keep_checkpoints", keep_checkpoints, minimum=1)
        check_int("diagnostics_interval", diagnostics_interval, minimum=1, allow_none=True)
        if port is None and self._next_port is not None:
            port, self._next_port = self._next_port, self._next_port + 1
        check_int("port", port, minimum=1, allow_none=True)
        if port is not None and port > 65535:
            raise ValueError(f"port must be a TCP port in 1..65535, got {port}")
        if extra_config is not None and not isinstance(extra_config, dict):
            raise TypeError(f"extra_config (the original's fit(kwargs=...)) must be a dict, got {extra_config!r}")
        if not isinstance(extend_run, bool):
            raise TypeError(f"extend_run must be True or False, got {extend_run!r}")
        if extend_run and resume_from is None:
            raise TypeError("extend_run=True continues a checkpointed run past its planned length; it needs "
                            "resume_from=")
        check_number("node_timeout", node_timeout, positive=True, allow_none=True)
        if node_timeout is not None and not math.isfinite(node_timeout):
            raise ValueError(f"node_timeout must be a finite number of seconds or None (no limit), got {node_timeout}")
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        if overwrite and resume_from is not None:
            raise ValueError("overwrite=True would delete the run that resume_from continues; drop one of them")
        if execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {execution!r}")
        time_model = build_time_model(num_nodes, network, node_speeds, device_flops, compute_time)
        minibatch_size = batch_size if minibatch_size is None else minibatch_size
        if minibatch_size > batch_size or batch_size % minibatch_size:
            raise ValueError(f"minibatch_size must divide batch_size={batch_size}, got {minibatch_size}")
        logger = resolve_logger(logger, run_name)
        run_name = run_name_of(logger, run_name)  # None: a default name is claimed below
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; use one of {list(BACKENDS)}")
        # Under torchrun (RANK, WORLD_SIZE set) backend="torch" runs only this process's node, and rank 0 logs.
        launch = launch_for_fit(backend, num_nodes, checkpoint_dir_shared=checkpoint_interval is None or
                                checkpoint_dir is not None or run_name is not None)
        is_main = launch is None or launch.rank == 0
        logger = logger if is_main else None
        node_devices = resolve_node_devices(
            num_nodes, device if device is not None or devices is not None else self.device,
            devices if devices is not None or device is not None else self.devices)
        if launch is not None:
            node_devices = launch.node_devices(node_devices)
        if checkpoint_dir is not None:
            check_writable(checkpoint_dir, "checkpoint_dir")
        memory_cap = memory_fraction(max_memory_usage, node_devices)
        loader = loader_options(dataloader_kwargs, node_devices)
        if autocast and any(d.type == "cuda" and not torch.cuda.is_bf16_supported() for d in node_devices):
            raise ValueError("autocast=True trains in bfloat16, which this GPU does not support; use autocast=False")

        # Data: every node's batches and the fixed validation batches, checked before any node starts.
        split = partition_data(self.train_dataset, partition, dirichlet_alpha, num_nodes, batch_size, seed,
                               shards_per_node=shards_per_node)
        node_batches = build_node_batches(self.train_dataset, split, num_nodes=num_nodes, batch_size=batch_size,
                                          shuffle=shuffle, seed=seed, loader=loader)
        steps_per_epoch = min(nb.steps_per_epoch for nb in node_batches)
        total_steps = max_steps if max_steps is not None else num_epochs * steps_per_epoch
        val_batches, val_size = build_val_batches(self.val_dataset, num_nodes=num_nodes, val_size=val_size,
                                                  batch_size=batch_size, seed=seed,
                                                  collate_fn=loader.get("collate_fn"))

        membership = build_membership(num_nodes, total_steps, failures, active_nodes)
        if membership is not None:
            if backend != "sim":
                raise ValueError(f"failures and active_nodes are simulated by backend='sim'; on backend={backend!r} "
                                 "the nodes are real processes that do not fail on a schedule")
            if not strategy.supports_membership_changes:
                raise ValueError(f"{type(strategy).__name__} cannot run with failures or active_nodes (see its "
                                 "docstring); drop them or use another strategy")

        cfg = RunConfig(num_nodes=num_nodes, max_steps=total_steps, batch_size=batch_size,
                        minibatch_size=minibatch_size, val_interval=val_interval,
                        log_interval=max(log_interval, 10),  # the nodes' host syncs of the loss; loggers: below
                        autocast=autocast, validate=val_batches is not None,
                        diagnostics_interval=diagnostics_interval, time_model=time_model,
                        steps_per_epoch=steps_per_epoch, membership=membership,
                        shard_sizes=tuple(nb.shard_size for nb in node_batches),
                        shard_steps=tuple(nb.steps_per_epoch for nb in node_batches))
        execution, execution_why = choose_execution(
            execution, model=self.model, first_batch=lambda: next(node_batches[0].iterate(from_step=0)),
            num_nodes=num_nodes, devices=node_devices, backend=backend, minibatch_size=minibatch_size,
            autocast=autocast, seed=seed, resume_from=resume_from, optim_spec=getattr(strategy, "optim_spec", None))
        n_params = sum(p.numel() for p in self.model.parameters())
        config = {"strategy": type(strategy).__name__, "strategy_config": strategy.config(), "num_nodes": num_nodes,
                  "max_steps": total_steps, "steps_per_epoch": steps_per_epoch, "num_epochs": num_epochs,
                  "batch_size": batch_size, "minibatch_size": minibatch_size, "global_batch": num_nodes * batch_size,
                  "shuffle": shuffle, "val_size": val_size if val_batches else 0, "val_interval": val_interval,
                  "log_interval": log_interval, "seed": seed, "backend": backend, "autocast": autocast,
                  "execution": execution, "execution_reason": execution_why,
                  "devices": [str(d) for d in node_devices], "model": type(self.model).__name__,
                  "parameters": n_params, "versions": versions()}
        if dataloader_kwargs is not None:
            config["dataloader_kwargs"] = {"given": dict(dataloader_kwargs), "applied": loader}
        if max_memory_usage is not None:
            config["max_memory_usage"] = max_memory_usage
        if port is not None:
            config["port"] = port
        if extra_config is not None:
            config["extra"] = dict(extra_config)
        if split is not None:
            config["partition"] = {"kind": partition, **split.settings, "sizes": split.sizes,
                                   "label_histograms": split.label_histograms()}
        if membership is not None:
            config["membership"] = {"failures": repr(failures), "active_nodes": repr(active_nodes),
                                    "schedule": membership.as_record()}
        if time_model is not None:
            config["time_model"] = {"network": repr(time_model.network), "node_speeds": list(time_model.node_speeds),
                                    "device_flops": list(time_model.device_flops), "compute_time": compute_time}
        if progress and is_main:
            announce(config, time_model)

        fingerprint = run_fingerprint(config, self.model, [nb.shard_size for nb in node_batches])
        run_id, resume, resume_after = uuid.uuid4().hex, None, None
        if resume_from is not None:  # the same run, or a refusal listing what differs, before any node starts
            folder = find_checkpoint(resume_from)
            manifest = read_manifest(folder)
            check_resume(manifest, folder, fingerprint, extend=extend_run)
            resume = load_checkpoint(folder, manifest, devices=node_devices)
            run_id = manifest["run_id"]
            saved_name = manifest.get("run_name")
            if isinstance(saved_name, str) and run_name in (None, saved_name):  # that very run: its own folder
                run_name, resume_after = saved_name, manifest["step"]
            config["resumed"] = {"checkpoint": str(folder), "step": manifest["step"]}
            if manifest["fingerprint"].get("max_steps") != total_steps:
                config["resumed"]["extended"] = {
                    "from_max_steps": manifest["fingerprint"]["max_steps"], "to_max_steps": total_steps,
                    "lr_schedule": "kept its original length: after it ends, its last learning rate continues"}
            if progress and is_main:
                print(f"exogym: resuming run {manifest.get('run_name')!r} from step {manifest['step']} ({folder})",
                      flush=True)
        # The run folder(s), claimed last: everything that can be checked before any node starts has been.
        default_ckpt = checkpoint_dir is None and checkpoint_interval is not None
        claim = claim_run_folders(logger, run_name,
                                  default_run_name({"strategy": type(strategy).__name__, "num_nodes": num_nodes}),
                                  extra_roots=["logs"] if default_ckpt and is_main else [], overwrite=overwrite,
                                  resume_after=resume_after) if is_main else None
        run_name = claim.name if claim is not None else run_name or default_run_name(config)
        config["run_name"] = run_name
        bar = None
        try:
            checkpoints = None
            if checkpoint_interval is not None or checkpoint_dir is not None:  # a folder alone: one, at the end
                root = Path(checkpoint_dir) if checkpoint_dir is not None else Path("logs") / run_name / "checkpoints"
                checkpoints = CheckpointPlan(check_writable(root, "checkpoint_dir"), checkpoint_interval or total_steps,
                                             keep_checkpoints, config, run_id, fingerprint)
                checkpoints.check_owner(overwrite=overwrite)
            bar = RunProgress(total_steps, initial=manifest["step"] if resume else 0) if progress and is_main else None
            live = LiveLog(logger, range(num_nodes) if launch is None else [launch.rank],  # torchrun: its own
                           global_batch=num_nodes * batch_size, log_interval=log_interval, last_step=total_steps,
                           progress=bar)
            plan = RunPlan(model=self.model, strategy=strategy, node_batches=node_batches, val_batches=val_batches,
                           devices=node_devices, cfg=cfg, seed=seed, live=live, checkpoints=checkpoints,
                           resume=resume, node_timeout=node_timeout, port=port,
                           execution=execution)
            if logger is not None:
                logger.start(config)
        except BaseException:
            if bar is not None:
                bar.close()
            if claim is not None:
                claim.abandon()
            raise
        start = time.perf_counter()
        caller_rng = GlobalRNGState.capture()  # the caller's random streams are theirs: put them back after
        try:
            memory_cap.apply()
            results = _RUNNERS[backend](plan)
        except BaseException as e:
            if bar is not None:
                bar.close()
            if logger is not None:
                logger.finish({"status": "failed", "error": f"{type(e).__name__}: {e}"})
            if claim is not None:
                claim.release("failed")
            raise
        finally:
            caller_rng.restore()
            memory_cap.reset()
        logs, final_state = [log for log, _ in results], results[0][1]
        self.record = RunRecord.from_nodes(logs, config=config, global_batch=num_nodes * batch_size,
                                           wall_time_s=time.perf_counter() - start,
                                           peak_memory_mb=peak_memory_mb(node_devices))
        if bar is not None:
            bar.close(self.record.summary())
        if logger is not None:
            logger.finish({"status": "completed", **self.record.summary()})
        if claim is not None:
            claim.release("completed")
        final_model = copy.deepcopy(self.model).to(node_devices[0])
        final_model.load_state_dict(final_state, strict=True)
        return final_model


LocalTrainer = Trainer
