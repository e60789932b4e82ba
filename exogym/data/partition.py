"""Non-IID splits of a labelled dataset across nodes.

"dirichlet" (Hsu et al. 2019, the standard federated-learning benchmark split): for every
class, its examples are divided among the nodes in proportions drawn from Dir(alpha, ..., alpha).
Small alpha (0.1) gives each node a few dominant classes; large alpha (100) approaches IID.
Every example goes to exactly one node, so each is used once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

__all__ = ["Partition", "dirichlet_partition", "dataset_labels"]


@dataclass
class Partition:
    """Per node: its example indices; plus what a record shows: shard sizes and label histograms."""

    indices: list[list[int]]
    num_classes: int
    labels: np.ndarray

    def subsets(self, ds: Dataset) -> list[Subset]:
        return [Subset(ds, idx) for idx in self.indices]

    @property
    def sizes(self) -> list[int]:
        return [len(idx) for idx in self.indices]

    def label_histograms(self) -> list[list[int]]:
        return [np.bincount(self.labels[idx], minlength=self.num_classes).tolist() for idx in self.indices]


def dataset_labels(ds: Dataset) -> np.ndarray:
    """The integer class label of every example: from .targets, a TensorDataset's second tensor, or item[1]."""
    for attr in ("targets", "labels"):
        if hasattr(ds, attr):
            return np.asarray(torch.as_tensor(getattr(ds, attr)).cpu()).astype(np.int64)
    if isinstance(ds, TensorDataset) and len(ds.tensors) >= 2:
        return ds.tensors[1].cpu().numpy().astype(np.int64)
    try:
        return np.asarray([int(ds[i][1]) for i in range(len(ds))], dtype=np.int64)
    except (TypeError, IndexError, ValueError) as e:
        raise TypeError("a label partition needs class labels: a dataset with .targets, a TensorDataset "
                        "(inputs, labels), or items (input, label)") from e


def dirichlet_partition(ds: Dataset, num_nodes: int, alpha: float, *, seed: int, min_size: int = 1,
                        max_draws: int = 1000) -> Partition:
    """Split `ds` by label with Dir(alpha) proportions; redraw until every node has at least min_size examples."""
    labels = dataset_labels(ds)
    num_classes = int(labels.max()) + 1 if len(labels) else 0
    rng = np.random.default_rng([seed, 0xD1])  # its own stream: the split never shifts other randomness
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    for _ in range(max_draws):
        shards: list[list[int]] = [[] for _ in range(num_nodes)]
        for members in by_class:
            cuts = (np.cumsum(rng.dirichlet([alpha] * num_nodes))[:-1] * len(members)).astype(int)
            for node, part in enumerate(np.split(members, cuts)):
                shards[node].extend(part.tolist())
        if min(len(s) for s in shards) >= min_size:
            return Partition([sorted(s) for s in shards], num_classes, labels)
    raise ValueError(f"could not split {len(labels)} examples into {num_nodes} Dirichlet(alpha={alpha}) shards of at "
                     f"least {min_size} examples (one batch) each in {max_draws} draws; raise alpha, lower "
                     "batch_size or use fewer nodes")
