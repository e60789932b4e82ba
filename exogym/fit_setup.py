"""Turning Trainer.fit's arguments into the parts of a run: node data, time model, logger, facts to record.

Each function validates what it builds and raises before any node starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from exogym._validation import check_number
from exogym.data.partition import Partition, dirichlet_partition, shards_partition
from exogym.data.sharding import DatasetOrFactory, NodeBatches, fixed_batches, is_factory, node_dataset
from exogym.runs.loggers import CSVLogger, Logger, MultiLogger, WandbLogger, _FolderLogger
from exogym.cluster.network import Network
from exogym.runs.disk import format_bytes
from exogym.runs.folder import RunClaim, check_run_name, claim_run
from exogym.runs.rerun import keep_earlier_run
from exogym.cluster.simtime import TimeModel

__all__ = ["DEFAULT_DEVICE_FLOPS", "NODE_OVERHEAD_BYTES", "available_memory_bytes", "check_node_memory",
           "partition_data", "build_node_batches", "build_val_batches", "build_time_model",
           "resolve_logger", "run_name_of", "claim_run_folders", "announce", "peak_memory_mb", "versions",
           "check_trainable"]

DEFAULT_DEVICE_FLOPS = 1e12  # a nominal sustained 1 TFLOP/s per node; pass device_flops for your hardware

def check_trainable(model: torch.nn.Module) -> None:
    """A run trains something: a model without a parameter that requires a gradient is refused before any node
    starts."""
    params = list(model.parameters())
    if not params:
        raise ValueError(f"the model {type(model).__name__} has no parameters, so there is nothing to train; pass a "
                         "model whose forward uses parameters (nn.Linear, ...)")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"the model {type(model).__name__} has no trainable parameters: all {len(params)} of them "
                         f"({sum(p.numel() for p in params):,} values) have requires_grad=False; unfreeze the ones "
                         "to train (p.requires_grad_(True))")


def build_node_batches(data: DatasetOrFactory, split: Partition | None, *, num_nodes: int, batch_size: int,
                       shuffle: bool, seed: int, loader: dict[str, Any] | None = None) -> list[NodeBatches]:
    """Each node's batches: its shard of one dataset, its part of a partition, or its factory's dataset."""
    shard = split is None and not is_factory(data)
    if shard:  # every shard holds ceil(len / num_nodes) examples (padded): checked once, before any node's is built
        examples = len(node_dataset(data, 0, num_nodes, is_val=False))
        if -(-examples // num_nodes) < batch_size:
            _too_few_examples(examples, f"num_nodes={num_nodes} x batch_size={batch_size} = {num_nodes * batch_size}")
    subsets = split.subsets(data) if split is not None else None
    node_batches = []
    for r in range(num_nodes):
        ds = subsets[r] if subsets is not None else node_dataset(data, r, num_nodes, is_val=False)
        nb = NodeBatches(ds, rank=r, num_nodes=num_nodes, batch_size=batch_size, shuffle=shuffle, seed=seed,
                         shard=shard, loader=loader)
        if nb.steps_per_epoch < 1:
            _too_few_examples(len(ds), f"batch_size={batch_size} for node {r}")
        node_batches.append(nb)
    return node_batches


def _too_few_examples(examples: int, need: str) -> None:
    raise ValueError(f"the training data has {examples} examples, fewer than one step needs ({need}); use fewer "
                     "nodes, a smaller batch_size, or more data")


# What one node costs besides its copy of the model: its copies of the strategy and optimizer objects, its data
# sampler, random streams, coroutine stack and log. Measured on the sim backend with a 780-byte model over 256 to
# 2048 nodes: 200 KiB (DDP) to 320 KiB (DiLoCo) per node. This floor under it keeps the estimate a lower bound.
NODE_OVERHEAD_BYTES = 128 * 1024


def available_memory_bytes() -> int | None:
    """Memory this process can still take: Linux's MemAvailable (free memory and what the kernel can reclaim), or
    less where a container's cgroup limit leaves less; elsewhere the free physical pages; None where unknown."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            found += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    cgroups = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2, then v1
               ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    for limit, usage in cgroups:
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max":
                found.append(max(0, int(cap) - int(Path(usage).read_text())))
        except (OSError, ValueError):
            pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name (macOS)
            pass
    return min(found) if found else None


def check_node_memory(num_nodes: int, *, model: torch.nn.Module | None = None, one_replica: bool = False,
                      devices: Sequence[torch.device] | None = None) -> None:
    """Refuse, before any node's data or model is built, more nodes than this machine's memory can hold.

    The estimate is a lower bound: NODE_OVERHEAD_BYTES per node, and each node on a CPU (not a GPU: devices, one
    per node) holds a copy of the model's parameters and buffers; when the strategy keeps one replica (DDP) the
    parameters are held once in all. Optimizer state, gradients and activations come on top. Under torchrun the
    machine holds its share of the nodes. Without a model (fit's first check of its arguments), the per-node
    overhead alone is counted, which already refuses num_nodes=10**9 at once."""
    available = available_memory_bytes()
    if available is None:
        return
    here = _nodes_on_this_machine(num_nodes)
    on_cpu = here if not devices else -(-here * sum(d.type != "cuda" for d in devices) // len(devices))
    params = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers()) if model is not None else 0
    copy = buffers + (0 if one_replica else params)  # what each node on a CPU holds of the model
    shared = params if one_replica and on_cpu else 0  # DDP's replica, held once
    need = here * NODE_OVERHEAD_BYTES + on_cpu * copy + shared
    if need <= available:
        return
    parts = [f"{here} node(s) x {format_bytes(NODE_OVERHEAD_BYTES)} of exogym's per-node state"]
    if on_cpu and copy:
        parts.append(f"{on_cpu} node(s) on the CPU x their model copy of {format_bytes(copy)}")
    if shared:
        parts.append(f"the parameters shared by the nodes, {format_bytes(shared)}")
    fits = max(0, (available - shared) // (NODE_OVERHEAD_BYTES + (copy if on_cpu else 0)))
    raise ValueError(f"num_nodes={num_nodes} needs at least {format_bytes(need)} of memory on this machine "
                     f"({' + '.join(parts)}), but {format_bytes(available)} is available; use at most {fits} nodes"
                     f"{', a smaller model' if len(parts) > 1 else ''}, or free some memory")


def _nodes_on_this_machine(num_nodes: int) -> int:
    """All of them; under torchrun (WORLD_SIZE and LOCAL_WORLD_SIZE set), this machine's share."""
    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and 0 < int(local) <= int(world):
        return -(-num_nodes * int(local) // int(world))
    return num_nodes


def build_val_batches(data: DatasetOrFactory | None, *, num_nodes: int, val_size: int, batch_size: int,
                      seed: int, collate_fn: Any = None) -> tuple[list[Any] | None, int]:
    """The fixed validation batches (node 0's validation data) and how many examples they hold."""
    if data is None:
        return None, 0
    val_ds = node_dataset(data, 0, num_nodes, is_val=True)
    if len(val_ds) == 0:
        raise ValueError("the validation dataset is empty; pass val_dataset=None to skip validation")
    val_size = min(val_size, len(val_ds))
    return fixed_batches(val_ds, size=val_size, batch_size=batch_size, seed=seed, collate_fn=collate_fn), val_size


def announce(config: dict[str, Any], time_model: TimeModel | None) -> None:
    """The derived numbers of a run, shown once at its start."""
    c = config
    print(f"exogym: {c['strategy']} on {c['num_nodes']} node(s) [{c['backend']}, {c['devices'][0]}], "
          f"{c['parameters']:,} parameters; batch {c['batch_size']}/node = {c['global_batch']} global; "
          f"{c['max_steps']} steps ({c['steps_per_epoch']} per epoch); validation on {c['val_size']} examples "
          f"every {c['val_interval']} steps", flush=True)
    if time_model is not None:
        compute = ("measured wall time" if time_model.measured else
                   f"counted FLOPs at {', '.join(f'{f:.3g}' for f in sorted(set(time_model.device_flops)))} "
                   "FLOP/s per node")
        print(f"exogym: simulated time on {time_model.network}; compute from {compute}; node speeds "
              f"{list(time_model.node_speeds)}", flush=True)


def partition_data(data: Any, partition: str, alpha: float | None, num_nodes: int, batch_size: int,
               seed: int, *, shards_per_node: int | None = None) -> Partition | None:
    """None for "iid" (DistributedSampler shards), else the label partition; each knob only with its kind."""
    if partition not in ("iid", "dirichlet", "shards"):
        raise ValueError(f"partition must be 'iid', 'dirichlet' or 'shards', got {partition!r}")
    if alpha is not None and partition != "dirichlet":
        raise TypeError(f"dirichlet_alpha only applies to partition='dirichlet', got partition={partition!r}; "
                        "drop dirichlet_alpha")
    if shards_per_node is not None and partition != "shards":
        raise TypeError(f"shards_per_node only applies to partition='shards', got partition={partition!r}; "
                        "drop shards_per_node")
    if partition == "iid":
        return None
    if is_factory(data):
        raise TypeError(f"partition={partition!r} splits one train_dataset; a dataset factory already gives each "
                        "node its own data")
    if partition == "shards":
        return shards_partition(data, num_nodes, 2 if shards_per_node is None else shards_per_node, seed=seed)
    check_number("dirichlet_alpha", alpha, positive=True)
    return dirichlet_partition(data, num_nodes, alpha, seed=seed, min_size=batch_size)


def build_time_model(num_nodes: int, network: Any, node_speeds: Any, device_flops: Any,
                compute_time: str) -> TimeModel | None:
    if compute_time not in ("flops", "measured"):
        raise ValueError(f"compute_time must be 'flops' or 'measured', got {compute_time!r}")
    if network is None and node_speeds is None and device_flops is None and compute_time == "flops":
        return None
    if network is None:
        network = Network.preset("ideal")
    elif isinstance(network, str):
        network = Network.preset(network)
    elif not isinstance(network, Network):
        raise TypeError(f"network must be an exogym.cluster.network.Network or a preset name, got {network!r}")
    network.check_nodes(num_nodes)
    speeds = _per_node("node_speeds", node_speeds, 1.0, num_nodes)
    flops = _per_node("device_flops", device_flops, DEFAULT_DEVICE_FLOPS, num_nodes)
    return TimeModel(network, speeds, flops, measured=compute_time == "measured")


def _per_node(name: str, value: Any, default: float, num_nodes: int) -> tuple[float, ...]:
    values = [default] * num_nodes if value is None else [value] * num_nodes if isinstance(value, (int, float)) \
        else list(value)
    if len(values) != num_nodes:
        raise ValueError(f"{name} needs one value per node (num_nodes={num_nodes}), got {len(values)}")
    for i, v in enumerate(values):
        check_number(f"{name}[{i}]", v, positive=True)
    return tuple(float(v) for v in values)


def resolve_logger(logger: Any, run_name: str | None) -> Logger | None:
    if logger is None or logger is True:
        return CSVLogger(run_name=run_name)
    if logger is False:
        return None
    if isinstance(logger, Logger):
        return logger
    if isinstance(logger, (list, tuple)) and all(isinstance(lg, Logger) for lg in logger):
        return MultiLogger(logger)
    raise TypeError(f"logger must be an exogym.runs.loggers.Logger (CSVLogger, WandbLogger, TensorBoardLogger), a list "
                    f"of them, or False for none; got {logger!r}")


def _loggers(logger: Logger | None) -> list[Logger]:
    if isinstance(logger, MultiLogger):
        return [inner for lg in logger.loggers for inner in _loggers(lg)]
    return [] if logger is None else [logger]


def run_name_of(logger: Logger | None, run_name: str | None) -> str | None:
    """The run's explicit name: fit's run_name, or the one its CSV/TensorBoard loggers were given (None: a default
    name is claimed). Names that disagree are an error: one run has one folder name."""
    if run_name is not None:
        check_run_name(run_name)
    names = {lg.requested_name for lg in _loggers(logger)
             if isinstance(lg, _FolderLogger) and lg.requested_name is not None}
    if run_name is not None and names - {run_name} or run_name is None and len(names) > 1:
        given = ([f"fit(run_name={run_name!r})"] if run_name is not None else []) + \
            [f"a logger's run_name={n!r}" for n in sorted(names)]
        raise ValueError(f"one run has one folder name, got {', '.join(given)}; give the name once (fit's "
                         "run_name) or the same name everywhere")
    return run_name if run_name is not None else next(iter(names), None)


def claim_run_folders(logger: Logger | None, name: str | None, default_name: str, *,
                      extra_roots: Sequence[str | os.PathLike] = (), overwrite: bool = False,
                      resume_after: int | None = None,
                      checkpoint_dir: str | os.PathLike | None = None) -> RunClaim | None:
    """Claim <root>/<name> for the run under every folder its loggers write (and extra_roots: the default
    checkpoint folder's logs/), before any node starts; hand the claimed name to the loggers. resume_after: the
    run continues in its own folder from its checkpoint at that step (rows after it are dropped). An ended run of
    the same explicit name is moved aside first, with its checkpoint_dir (exogym.runs.rerun), unless overwrite.
    None when nothing is written into a run folder."""
    loggers = _loggers(logger)
    folder_loggers = [lg for lg in loggers if isinstance(lg, _FolderLogger)]
    roots = [lg.log_dir for lg in folder_loggers] + [Path(r) for r in extra_roots]
    if name is not None and not overwrite and resume_after is None:
        keep_earlier_run([root / name for root in roots], name, checkpoint_dir)
    if not roots:
        return None
    claim = claim_run(roots, name, default_name, overwrite=overwrite, resume=resume_after is not None)
    for lg in folder_loggers:
        lg.run_name, lg.claim = claim.name, claim
        if resume_after is not None:
            lg.continue_after(resume_after)
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg.run_name is None:
            lg.run_name = claim.name  # wandb names its own folders with a unique run id; this is the display name
    return claim


def peak_memory_mb(devices: list[torch.device]) -> dict[str, float]:
    """This process's peak resident memory, and each CUDA device's peak allocation, in MB."""
    peaks: dict[str, float] = {}
    try:
        import resource
        import sys
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks["process_rss"] = rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux
    except ImportError:  # Windows
        pass
    for d in sorted({d for d in devices if d.type == "cuda"}, key=str):
        peaks[str(d)] = torch.cuda.max_memory_allocated(d) / 2**20
    return peaks


def versions() -> dict[str, str]:
    import platform

    import exogym
    return {"exogym": exogym.__version__, "torch": torch.__version__, "python": platform.python_version()}


