"""Non-IID splits of a labelled dataset across nodes.

"dirichlet" (Hsu et al. 2019, the standard federated-learning benchmark split): for every
class, its examples are divided among the nodes in proportions drawn from Dir(alpha, ..., alpha).
Small alpha (0.1) gives each node a few dominant classes; large alpha (100) approaches IID.
"shards" (McMahan et al. 2017, the FedAvg paper's "pathological non-IID" MNIST split): sort the
examples by label, cut them into num_nodes x shards_per_node equal shards, and deal each node
shards_per_node of them at random; with 2 shards of MNIST most nodes see only two digits.
Every example goes to exactly one node, so each is used once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from exogym._validation import check_int

__all__ = ["Partition", "dirichlet_partition", "shards_partition", "dataset_labels"]


@dataclass
class Partition:
    """Per node: its example indices; plus what a record shows: the split's settings, shard sizes and label histograms.

    Args:
        indices: Per node, its example indices.
        num_classes: The number of classes.
        labels: Every example's label.
        settings: The split's settings, e.g. `{"dirichlet_alpha": 0.1}`.
    """

    indices: list[list[int]]
    num_classes: int
    labels: np.ndarray
    settings: dict[str, Any] = field(default_factory=dict)  # e.g. {"dirichlet_alpha": 0.1}

    def subsets(self, ds: Dataset) -> list[Subset]:
        """Each node's examples as a Subset of `ds`.

        Args:
            ds: The dataset that was split.

        Returns:
            One Subset per node.
        """
        return [Subset(ds, idx) for idx in self.indices]

    @property
    def sizes(self) -> list[int]:
        """Per node, its number of examples."""
        return [len(idx) for idx in self.indices]

    def label_histograms(self) -> list[list[int]]:
        """Per node, how many of its examples carry each label.

        Returns:
            One list of `num_classes` counts per node.
        """
        return [np.bincount(self.labels[idx], minlength=self.num_classes).tolist() for idx in self.indices]


def dataset_labels(ds: Dataset) -> np.ndarray:
    """The integer class label of every example: from `.targets`, a TensorDataset's second tensor, or `item[1]`.

    Args:
        ds: The dataset.

    Returns:
        The labels, an int array.

    Raises:
        TypeError: The dataset has no class labels.
    """
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
    """Split `ds` by label with Dir(alpha) proportions; redraw until every node has at least `min_size` examples.

    Args:
        ds: A labelled dataset.
        num_nodes: The number of nodes.
        alpha: The Dirichlet concentration (small: each node sees few labels).
        seed: The seed of the draws.
        min_size: The fewest examples a node may get (one batch).
        max_draws: The most draws before giving up.

    Returns:
        The Partition.

    Raises:
        ValueError: No draw gave every node `min_size` examples (saying what to change).
    """
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
            return Partition([sorted(s) for s in shards], num_classes, labels, {"dirichlet_alpha": alpha})
    raise ValueError(f"could not split {len(labels)} examples into {num_nodes} Dirichlet(alpha={alpha}) shards of at "
                     f"least {min_size} examples (one batch) each in {max_draws} draws; raise alpha, lower "
                     "batch_size or use fewer nodes")


def shards_partition(ds: Dataset, num_nodes: int, shards_per_node: int = 2, *, seed: int) -> Partition:
    """The FedAvg paper's pathological non-IID split (McMahan et al. 2017, sec. 3).

    Sort `ds` by label (stable), cut it into `num_nodes x shards_per_node` equal, label-contiguous shards and
    deal each node `shards_per_node` of them by a seeded permutation.

    Args:
        ds: A labelled dataset.
        num_nodes: The number of nodes.
        shards_per_node: The shards each node gets.
        seed: The seed of the permutation.

    Returns:
        The Partition.

    Raises:
        ValueError: Fewer examples than shards.
    """
    check_int("num_nodes", num_nodes, minimum=1)
    check_int("shards_per_node", shards_per_node, minimum=1)
    labels = dataset_labels(ds)
    n, num_shards = len(labels), num_nodes * shards_per_node
    if n == 0 or n % num_shards:
        fits = [s for s in range(1, 11) if n and n % (num_nodes * s) == 0]
        hint = f"use shards_per_node in {fits}" if fits else "change num_nodes"
        raise ValueError(f"partition='shards' cuts the {n} training examples into num_nodes x shards_per_node = "
                         f"{num_nodes} x {shards_per_node} = {num_shards} equal shards, so {num_shards} must divide "
                         f"{n}; {hint}, or use partition='dirichlet'")
    by_label = np.argsort(labels, kind="stable").reshape(num_shards, n // num_shards)  # [shards, shard size]
    rng = np.random.default_rng([seed, 0x5A])  # its own stream: the split never shifts other randomness
    dealt = rng.permutation(num_shards).reshape(num_nodes, shards_per_node)  # node r gets shards dealt[r]
    indices = [sorted(by_label[shards].ravel().tolist()) for shards in dealt]
    return Partition(indices, int(labels.max()) + 1, labels,
                     {"shards_per_node": shards_per_node, "shard_size": n // num_shards})
