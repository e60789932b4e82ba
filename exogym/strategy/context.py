"""NodeContext: the facts of a run that a strategy on one node may read, handed over once at setup."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NodeContext"]


@dataclass(frozen=True)
class NodeContext:
    """What the node tells its strategy (and the strategy its communication modules) before the first step.

    rank / num_nodes: this node and how many there are (up or down). max_steps: the run's last step (an LR
    schedule's length). steps_per_epoch: one pass over the smallest node's shard, the same on every node.
    shard_size: examples in this node's training data per epoch (differs across nodes with unequal shards).
    shard_sizes / shard_steps: every node's shard_size, and its steps in one pass over its own shard, by rank
    (FedAvg weights by the first and runs E passes of the second; () where a run does not say).
    execution: "sequential" (each node computes with its own module) or "fused" (exogym.fused: the nodes'
    parameters are views of stacked tensors).
    """

    rank: int
    num_nodes: int
    max_steps: int
    steps_per_epoch: int = 1
    shard_size: int = 0
    shard_sizes: tuple[int, ...] = ()
    shard_steps: tuple[int, ...] = ()
    execution: str = "sequential"
