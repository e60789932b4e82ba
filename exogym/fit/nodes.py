"""Every node's share of a fit call, built and checked before any node starts: its training data (a shard, a part of
a label partition, or its factory's dataset), the fixed validation batches, who is up when, and whether this
machine's memory holds the nodes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from exogym._validation import check_number
from exogym.cluster.membership import Membership, build_membership
from exogym.data.partition import Partition, dirichlet_partition, shards_partition
from exogym.data.sharding import DatasetOrFactory, NodeBatches, fixed_batches, is_factory, node_dataset
from exogym.fit.config import FitConfig
from exogym.launch.environment import Environment, detect_environment
from exogym.runs.disk import format_bytes

__all__ = ["RunData", "build_run_data", "NODE_OVERHEAD_BYTES", "available_memory_bytes", "check_node_memory",
           "partition_data", "build_node_batches", "build_val_batches", "check_trainable", "peak_memory_mb"]


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


def build_run_data(c: FitConfig, train_dataset: DatasetOrFactory, val_dataset: DatasetOrFactory | None,
                   loader: dict[str, Any]) -> RunData:
    """Every node's batches, the fixed validation batches and who is up when, checked before any node starts.

    Args:
        c: the fit call's configuration.
        train_dataset: the Trainer's training data (a Dataset or a factory).
        val_dataset: its validation data, or None.
        loader: the DataLoader options that apply (exogym.data.loader_options).

    Returns:
        The run's data.

    Raises:
        ValueError: too little data for a step, or failures / an elastic pool where they cannot run.
        TypeError: a partition's knob without its partition.
    """
    s, n = c.schedule, c.num_nodes
    split = partition_data(train_dataset, c.data.partition, c.data.dirichlet_alpha, n, s.batch_size, s.seed,
                           shards_per_node=c.data.shards_per_node)
    node_batches = build_node_batches(train_dataset, split, num_nodes=n, batch_size=s.batch_size, shuffle=s.shuffle,
                                      seed=s.seed, loader=loader)
    steps_per_epoch = min(nb.steps_per_epoch for nb in node_batches)
    total_steps = s.max_steps if s.max_steps is not None else s.num_epochs * steps_per_epoch
    val_batches, val_size = build_val_batches(val_dataset, num_nodes=n, val_size=s.val_size, batch_size=s.batch_size,
                                              seed=s.seed, collate_fn=loader.get("collate_fn"))
    membership = build_membership(n, total_steps, c.simulation.failures, c.simulation.active_nodes)
    if membership is not None:
        backend = c.launch.backend
        if backend != "sim":
            raise ValueError(f"failures and active_nodes are simulated by backend='sim'; on backend={backend!r} "
                             "the nodes are real processes that do not fail on a schedule")
        if not c.strategy.supports_membership_changes:
            raise ValueError(f"{type(c.strategy).__name__} cannot run with failures or active_nodes (see its "
                             "docstring); drop them or use another strategy")
    return RunData(split, node_batches, steps_per_epoch, total_steps, val_batches, val_size, membership)


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
                      devices: Sequence[torch.device] | None = None, environment: Environment | None = None) -> None:
    """Refuse, before any node's data or model is built, more nodes than this machine's memory can hold.

    The estimate is a lower bound: NODE_OVERHEAD_BYTES per node, and each node on a CPU (not a GPU: devices, one
    per node) holds a copy of the model's parameters and buffers; when the strategy keeps one replica (DDP) the
    parameters are held once in all. Optimizer state, gradients and activations come on top. Under torchrun the
    machine holds its share of the nodes. Without a model (fit's first check of its arguments), the per-node
    overhead alone is counted, which already refuses num_nodes=10**9 at once."""
    available = available_memory_bytes()
    if available is None:
        return
    here = (environment or detect_environment()).nodes_on_this_machine(num_nodes)
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


def peak_memory_mb(devices: list[torch.device], logs: Sequence[Any] = (), owner: Sequence[int] = (),
                   caller_counts: bool = True) -> dict[str, Any]:
    """The run's peak memory in MB: this process's peak resident memory ("process_rss"), each CUDA device's peak
    allocation, and for a run over several processes each process's peak ("per_process_rss", by process) and
    their sum with the caller's ("run_rss", an upper bound: pages the processes share count once per process).

    Args:
        devices: the nodes' devices.
        logs: every node's log; a node's process stamps its peak in log.comm["process_peak_rss_mb"].
        owner: the process of each node, by rank.
        caller_counts: whether this process is not itself one of those processes (a local launch's caller), so
            that its own peak adds to the run's.
    """
    peaks: dict[str, Any] = {}
    try:
        import resource
        import sys
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks["process_rss"] = rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux
    except ImportError:  # Windows
        pass
    for d in sorted({d for d in devices if d.type == "cuda"}, key=str):
        peaks[str(d)] = torch.cuda.max_memory_allocated(d) / 2**20
    per_process: dict[int, float] = {}
    for log, p in zip(logs, owner):
        rss = getattr(log, "comm", {}).get("process_peak_rss_mb")
        if rss is not None:
            per_process.setdefault(p, rss)
    if per_process:
        peaks["per_process_rss"] = [per_process.get(p, math.nan) for p in range(max(owner) + 1)]
        peaks["run_rss"] = sum(per_process.values()) + (peaks.get("process_rss", 0.0) if caller_counts else 0.0)
    else:
        peaks["run_rss"] = peaks.get("process_rss", math.nan)
    return peaks
