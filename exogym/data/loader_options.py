"""fit(dataloader_kwargs=...): the torch DataLoader options that mean something for exogym's batches.

exogym chooses every node's batches itself (a DistributedSampler-style shard, a partition or a factory's
dataset, cut into batch_size pieces from fit's seed). What a DataLoader adds on top of that choice is how
the chosen examples are loaded: in worker processes (num_workers, prefetch_factor, persistent_workers,
timeout, worker_init_fn, multiprocessing_context), into pinned memory (pin_memory), and collated by your
function (collate_fn). Those are applied: each node loads its batches through a DataLoader over exactly
the indices it would have used, so the examples and their order do not change. The options that would
choose the examples are rejected, each with the fit argument that does it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from exogym._validation import check_int, check_number, reject_unknown_kwargs

__all__ = ["LoaderOptions", "loader_options"]

_APPLIED = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout", "worker_init_fn",
            "multiprocessing_context", "collate_fn")
_WHY_NOT = {
    "batch_size": "the batch size is fit's batch_size (minibatch_size for gradient accumulation)",
    "shuffle": "shuffling is fit's shuffle (reshuffled every epoch from fit's seed)",
    "sampler": "exogym splits the data across nodes itself; for your own split pass a dataset factory "
               "f(rank, num_nodes, is_val) or fit(partition=...)",
    "batch_sampler": "exogym cuts each node's shard into batches itself; for your own split pass a dataset "
                     "factory f(rank, num_nodes, is_val)",
    "drop_last": "incomplete final batches are always dropped, so every step has the same global batch",
    "generator": "the order of the examples comes from fit's seed",
}

LoaderOptions = dict  # the DataLoader keyword arguments applied to every node's training batches


def loader_options(dataloader_kwargs: Mapping[str, Any] | None, devices: Sequence[torch.device]) -> LoaderOptions:
    """The validated DataLoader options of fit's `dataloader_kwargs` (`{}` for none).

    `pin_memory` only pins when a node runs on a GPU. The examples and their order stay exogym's: options that
    would change them (a sampler, a batch size, shuffling) are refused.

    Args:
        dataloader_kwargs: fit's `dataloader_kwargs`, or None.
        devices: The nodes' devices.

    Returns:
        The options to apply.

    Raises:
        TypeError: Not a dict, an unknown option, or one that cannot be applied (saying why).
        ValueError: A value out of range.
    """
    if dataloader_kwargs is None:
        return {}
    if not isinstance(dataloader_kwargs, Mapping):
        raise TypeError(f"dataloader_kwargs must be a dict of torch DataLoader options, got {dataloader_kwargs!r}")
    options = dict(dataloader_kwargs)
    for name, why in _WHY_NOT.items():
        if name in options:
            raise TypeError(f"dataloader_kwargs[{name!r}] cannot be applied: {why}; drop it from dataloader_kwargs")
    reject_unknown_kwargs("dataloader_kwargs", {k: v for k, v in options.items() if k not in _APPLIED}, _APPLIED)
    workers = options.get("num_workers", 0)
    check_int("dataloader_kwargs['num_workers']", workers, minimum=0)
    for needs_workers in ("prefetch_factor", "persistent_workers"):
        if options.get(needs_workers) and workers == 0:
            raise ValueError(f"dataloader_kwargs[{needs_workers!r}]={options[needs_workers]!r} needs num_workers > 0 "
                             "(it configures the worker processes); add num_workers or drop it")
    if "timeout" in options:
        check_number("dataloader_kwargs['timeout']", options["timeout"], minimum=0.0)
    if "collate_fn" in options and not callable(options["collate_fn"]):
        raise TypeError(f"dataloader_kwargs['collate_fn'] must be callable, got {options['collate_fn']!r}")
    if options.get("pin_memory") and not any(d.type == "cuda" for d in devices):
        options["pin_memory"] = False  # pinned memory only speeds up copies to a CUDA device; no node has one
    return options
