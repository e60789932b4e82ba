"""Which examples each node sees, batch by batch.

A plain Dataset is split into disjoint per-node shards with DistributedSampler semantics
(one seeded permutation per epoch, padded to a multiple of num_nodes, node r takes every
num_nodes-th index from r). A factory f(rank, num_nodes, is_val) -> Dataset gives each node
a dataset of its own instead, which is shuffled but not split. A Hugging Face `datasets.Dataset` is
read a batch at a time and becomes a dict of tensors, one per column (with set_format("torch") or
from plain rows of numbers or lists).
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset, TensorDataset
from torch.utils.data import default_collate

__all__ = ["DatasetOrFactory", "node_dataset", "NodeBatches", "keep_rows_read", "fixed_batches", "split_batch",
           "batch_size_of", "move_to_device", "token_count"]

DatasetOrFactory = Union[Dataset, Callable[[int, int, bool], Dataset]]


def is_factory(data: object) -> bool:
    return callable(data) and not isinstance(data, Dataset)


def node_dataset(data: DatasetOrFactory, rank: int, num_nodes: int, is_val: bool) -> Dataset:
    """The dataset node `rank` draws from (the whole dataset when it is to be sharded).

    A factory is called `f(rank, num_nodes, is_val)`; one whose third parameter is named `train_dataset` (the
    original EXO Gym's convention: True for the training data) is called `f(rank, num_nodes, train_dataset=...)`.

    Args:
        data: A Dataset or a factory.
        rank: The node.
        num_nodes: The number of nodes.
        is_val: Whether this is the validation data.

    Returns:
        The dataset.

    Raises:
        TypeError: What a factory returned is not a map-style Dataset.
    """
    if is_factory(data):
        ds = data(rank, num_nodes, train_dataset=not is_val) if _takes_train_flag(data) else data(rank, num_nodes,
                                                                                                   is_val)
    else:
        ds = data
    kind = "validation" if is_val else "training"
    if isinstance(ds, IterableDataset) or not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
        source = f"the dataset factory returned for node {rank}" if is_factory(data) else "the dataset"
        raise TypeError(f"the {kind} data must be a map-style Dataset (with __len__ and __getitem__); "
                        f"{source} is {type(ds).__name__}")
    return ds


def _takes_train_flag(factory: Callable[..., Any]) -> bool:
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return len(params) >= 3 and params[2].name == "train_dataset"


def _collate(ds: Dataset, indices: list[int]) -> Any:
    if isinstance(ds, TensorDataset):  # fast path: one gather per tensor instead of one item at a time
        return _gather(ds.tensors, torch.as_tensor(indices, dtype=torch.long))
    if isinstance(ds, _Rows):  # the same gather, from the rows a process holds
        return _gather(ds.tensors, ds.local(indices))
    if _is_hf_dataset(ds):  # one columnar read: {column: the rows' values}
        return {name: _column(values) for name, values in ds[indices].items()}
    return default_collate([ds[i] for i in indices])


def _gather(tensors: Sequence[torch.Tensor], idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor's rows `idx`: t[idx]'s values, by index_select (no advanced indexing's dispatch). A tensor on
    another device than `idx` (a dataset kept on the GPU) gets the index moved to it."""
    return tuple([t.index_select(0, idx if t.device == idx.device else idx.to(t.device)) for t in tensors])


def _is_hf_dataset(ds: object) -> bool:
    """A Hugging Face `datasets.Dataset` (duck-typed: the package is an optional extra)."""
    return type(ds).__module__.split(".")[0] == "datasets" and hasattr(ds, "column_names")


def _column(values: Any) -> Any:
    """A column of a batch as one tensor [B, ...]: from a tensor (set_format("torch")), tensors of one shape,
    or rows of numbers / lists of numbers (no format). Anything else (text, ragged rows) stays a list."""
    if isinstance(values, torch.Tensor):
        return values
    if values and all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values) if len({v.shape for v in values}) == 1 else values
    try:
        return torch.tensor(values)
    except (TypeError, ValueError, RuntimeError):
        return values


class NodeBatches:
    """Node `rank`'s training batches, epoch after epoch.

    Incomplete final batches are dropped so every step has the same global batch.

    Args:
        ds: The dataset the node draws from.
        rank: The node.
        num_nodes: The number of nodes.
        batch_size: Examples per batch.
        shuffle: A new seeded permutation every epoch.
        seed: The permutation's seed.
        shard: Take this node's share of `ds` (False: `ds` is the node's own, from a factory or a partition).
        loader: DataLoader options (`exogym.data.loader_options`): how the batches load, not which.
    """

    def __init__(self, ds: Dataset, *, rank: int, num_nodes: int, batch_size: int, shuffle: bool, seed: int,
                 shard: bool, loader: dict[str, Any] | None = None):
        self.ds, self.batch_size = ds, batch_size
        self.num_nodes, self.shuffle, self.seed, self.sharded = num_nodes, shuffle, seed, shard
        self.loader = dict(loader or {})  # DataLoader options (exogym.data.loader_options): how, not which
        self.sampler = DistributedSampler(ds, num_replicas=num_nodes if shard else 1, rank=rank if shard else 0,
                                          shuffle=shuffle, seed=seed)
        self.steps_per_epoch = self.sampler.num_samples // batch_size
        self.shard_size = self.sampler.num_samples  # examples per epoch of this node (padded when sharded)

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(from_step=0)

    def iterate(self, from_step: int) -> Iterator[Any]:
        """Batches from step `from_step` on (a resumed run continues mid-epoch on the same permutation).

        Args:
            from_step: The steps already done.

        Returns:
            An iterator of batches.
        """
        if self.loader:  # the same index lists, loaded by a DataLoader (workers, pinned memory, your collate_fn)
            return iter(DataLoader(self.ds, batch_sampler=_Indices(self, from_step), **self.loader))
        if isinstance(self.ds, (TensorDataset, _Rows)):  # gathered by index tensors: no list of ints per epoch
            return (_collate(self.ds, idx) for idx in self._index_tensors(from_step))
        return (_collate(self.ds, idx) for idx in self.index_batches(from_step))

    def of_shard(self, shard: int) -> "NodeBatches":
        """The batches of shard `shard` (what node `shard` reads by default), with this node's loading options: the
        asynchronous strategies' shard sampling hands a node another node's shard for a task.

        Args:
            shard: The shard, a rank in 0..num_nodes-1.

        Returns:
            New node batches over the same dataset (these are untouched).

        Raises:
            ValueError: The data is not one dataset sharded over the nodes (a factory gives each node its own), or
                this process holds only its own nodes' examples (a run over several processes).
        """
        if not self.sharded:
            raise ValueError("shard sampling reads other nodes' shards of one dataset; the training data here is "
                             "each node's own (a factory f(rank, num_nodes, is_val), or a partition): pass one "
                             "Dataset to Trainer, or leave shard_sampling=None")
        base = self.ds.dataset if isinstance(self.ds, Subset) else self.ds
        if isinstance(base, _Rows):
            raise ValueError("shard sampling reads other nodes' shards, and this process holds only its own nodes' "
                             "examples (a run over several processes); run it with processes=1")
        other = copy.copy(self)
        other.sampler = DistributedSampler(self.ds, num_replicas=self.num_nodes, rank=shard, shuffle=self.shuffle,
                                           seed=self.seed)
        return other

    def index_batches(self, from_step: int) -> Iterator[list[int]]:
        """The example indices of each batch from step `from_step` on, epoch after epoch.

        Args:
            from_step: The steps already done.

        Returns:
            An iterator of index lists.
        """
        epoch, first = divmod(from_step, self.steps_per_epoch)
        while True:
            self.sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every node
            indices = list(self.sampler)
            for i in range(first, self.steps_per_epoch):
                yield indices[i * self.batch_size:(i + 1) * self.batch_size]
            epoch, first = epoch + 1, 0


    def _index_tensors(self, from_step: int) -> Iterator[torch.Tensor]:
        """index_batches' batches as int64 tensors: slices of one tensor per epoch (sampler_order)."""
        epoch, first = divmod(from_step, self.steps_per_epoch)
        while True:
            order = sampler_order(self.sampler, epoch)  # [num_samples]
            for i in range(first, self.steps_per_epoch):
                yield order[i * self.batch_size:(i + 1) * self.batch_size]
            epoch, first = epoch + 1, 0


def sampler_order(sampler: DistributedSampler, epoch: int) -> torch.Tensor:
    """The indices `sampler` yields in `epoch`, as one int64 tensor, computed as DistributedSampler.__iter__ computes
    them (its seeded permutation, padded by repeating it or cut to total_size, every num_replicas-th from rank) but
    without a Python list of the whole dataset's indices; tests/data checks the two agree.

    Args:
        sampler: The sampler (its dataset's length, seed, shuffle, drop_last, rank and replicas are read).
        epoch: The epoch (the sampler's own `set_epoch` is not needed or changed).

    Returns:
        A tensor of the sampler's num_samples indices.
    """
    n = len(sampler.dataset)
    indices = _permutation(n, sampler.seed + epoch) if sampler.shuffle else torch.arange(n)
    if sampler.total_size > n:  # padded (drop_last=False): the permutation repeated from its start
        indices = indices.repeat(-(-sampler.total_size // n))
    # a copy of its own (the permutation is shared), contiguous: its batches are views of it
    return indices[sampler.rank:sampler.total_size:sampler.num_replicas].clone(memory_format=torch.contiguous_format)


class _Permutations:
    """randperm(n) drawn with a generator seeded `seed`, kept for the next node that asks (every node of a run draws
    the same permutation each epoch, as DistributedSampler does), the most recent first, up to `limit_bytes`."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes, self._kept, self._lock = limit_bytes, OrderedDict(), threading.Lock()

    def __call__(self, n: int, seed: int) -> torch.Tensor:
        with self._lock:
            kept = self._kept.get((n, seed))
            if kept is not None:
                self._kept.move_to_end((n, seed))
                return kept
        g = torch.Generator()
        g.manual_seed(seed)
        perm = torch.randperm(n, generator=g)
        with self._lock:
            self._kept[(n, seed)] = perm
            while sum(p.nbytes for p in self._kept.values()) > self.limit_bytes and len(self._kept) > 1:
                self._kept.popitem(last=False)
        return perm


_permutation = _Permutations(limit_bytes=64 * 2**20)  # read only: callers copy what they keep (sampler_order)


class _Length:
    """Stands for a dataset where only its length is read (the sampler's permutation is of the whole dataset)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


class _Rows(Dataset):
    """The rows of a TensorDataset that some nodes read, addressed by their indices in the whole dataset: the same
    items and batches as the whole one, for those indices."""

    def __init__(self, ds: TensorDataset, rows: Sequence[int]):
        self.rows = torch.as_tensor(sorted(set(rows)), dtype=torch.long)  # [R] ascending indices into ds
        self.tensors = tuple(t[self.rows] for t in ds.tensors)  # [R, ...] each
        self.n = len(ds)

    def local(self, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(indices, dtype=torch.long)
        local = torch.searchsorted(self.rows, idx)
        if len(idx) and (local.max() >= len(self.rows) or not torch.equal(self.rows[local], idx)):
            raise IndexError("an example this process was not given was read; it holds the examples its nodes read "
                             "in this run only")
        return local

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        j = int(self.local([i])[0])
        return tuple(t[j] for t in self.tensors)


_NARROW_EPOCHS = 4  # the longest run (in epochs touched) whose nodes are sent only the rows they read


def keep_rows_read(batches: NodeBatches, from_step: int, to_step: int) -> NodeBatches:
    """Node batches holding only the examples they yield from step `from_step` up to `to_step`, with the same
    batches for those steps (a process is sent its own nodes' examples, not the whole dataset).

    Only a TensorDataset, or a Subset of one, is narrowed, only without DataLoader options (whose workers may read
    ahead), and only for a run of at most _NARROW_EPOCHS epochs (a longer one reads most of the data anyway, and
    listing its indices would cost more than it saves); any other dataset is kept whole.

    Args:
        batches: a node's batches over the whole dataset.
        from_step: the first step the node runs (its checkpoint's, on a resumed run).
        to_step: the run's last step.

    Returns:
        New node batches (the given ones are untouched), or the given ones where nothing can be narrowed.
    """
    ds = batches.ds
    base = ds.dataset if isinstance(ds, Subset) else ds
    if batches.loader or not isinstance(base, TensorDataset) or to_step <= from_step:
        return batches
    spe = batches.steps_per_epoch
    if (to_step - 1) // spe - from_step // spe + 1 > _NARROW_EPOCHS:
        return batches
    read = [i for _, idx in zip(range(to_step - from_step), batches.index_batches(from_step)) for i in idx]
    if isinstance(ds, Subset):
        read = [ds.indices[i] for i in read]
    rows = _Rows(base, read)
    narrowed = copy.copy(batches)
    narrowed.ds = Subset(rows, ds.indices) if isinstance(ds, Subset) else rows
    narrowed.sampler = copy.copy(batches.sampler)
    narrowed.sampler.dataset = _Length(len(ds))  # the sampler reads only the length of what it permutes
    return narrowed


class _Indices:
    """A DataLoader batch_sampler over a node's index batches (endless: the node stops at max_steps)."""

    def __init__(self, batches: NodeBatches, from_step: int):
        self.batches, self.from_step = batches, from_step

    def __iter__(self) -> Iterator[list[int]]:
        return self.batches.index_batches(self.from_step)


def fixed_batches(ds: Dataset, *, size: int, batch_size: int, seed: int,
                  collate_fn: Callable[[list[Any]], Any] | None = None) -> list[Any]:
    """The same `size` examples for every evaluation (a seeded choice), in batches of `batch_size`.

    Args:
        ds: The validation dataset.
        size: How many examples.
        batch_size: Examples per batch.
        seed: The seed of the choice.
        collate_fn: How examples are stacked into a batch (default: torch's).

    Returns:
        The batches.
    """
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randperm(len(ds), generator=gen)[:size].tolist()
    return [_collate(ds, indices[i:i + batch_size]) if collate_fn is None else
            collate_fn([ds[j] for j in indices[i:i + batch_size]]) for i in range(0, len(indices), batch_size)]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors inside tensors, tuples, lists and dicts to `device`; leave anything else as it is.

    Args:
        batch: The batch.
        device: The device.

    Returns:
        The batch on `device`.
    """
    if isinstance(batch, torch.Tensor):  # one already there stays as it is (what .to returns, without the dispatch)
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def token_count(batch: Any) -> int | None:
    """Tokens in a batch of token ids (the first integer tensor with a sequence dimension), else None.

    Args:
        batch: The batch.

    Returns:
        The number of tokens, or None.
    """
    if isinstance(batch, torch.Tensor):
        return batch.numel() if batch.dim() >= 2 and not batch.is_floating_point() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        if isinstance(v, torch.Tensor):
            return token_count(v)
    return None


def batch_size_of(batch: Any) -> int:
    """Examples in a batch: the leading dimension of its first tensor.

    Args:
        batch: A tensor, or tuples, lists and dicts of them.

    Returns:
        The number of examples.

    Raises:
        TypeError: The batch holds no tensor.
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        try:
            return batch_size_of(v)
        except TypeError:
            continue
    raise TypeError(f"cannot find a tensor in the batch to take its size from: {type(batch).__name__}")


def split_batch(batch: Any, size: int) -> list[Any]:
    """Split every tensor in the batch along dim 0 into chunks of `size` (gradient accumulation).

    Args:
        batch: The batch.
        size: Examples per chunk.

    Returns:
        The chunks, each shaped like `batch`.
    """
    if isinstance(batch, torch.Tensor):
        return list(batch.split(size))
    if isinstance(batch, dict):
        parts = {k: split_batch(v, size) for k, v in batch.items()}
        n = max(len(p) for p in parts.values())
        return [{k: (p[i] if len(p) == n else batch[k]) for k, p in parts.items()} for i in range(n)]
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(v, size) for v in batch]
        n = max(len(p) for p in parts)
        rows = [[p[i] if len(p) == n else v for p, v in zip(parts, batch)] for i in range(n)]
        return [type(batch)(*r) if hasattr(batch, "_fields") else type(batch)(r) for r in rows]
    return [batch]
