"""NodeContext: the facts of a run that a strategy on one node may read, handed over once at setup."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

__all__ = ["NodeContext", "KeepOnce", "keep_once_per_node", "keep_once"]

# keep_once(key, make) -> the object every node of this process whose strategy asks with `key` shares.
KeepOnce = Callable[[Hashable, Callable[[], Any]], Any]


def keep_once_per_node(key: Hashable, make: Callable[[], Any]) -> Any:
    """Every node makes its own (one node per process, as on torch.distributed; or no run at all)."""
    return make()


@dataclass(frozen=True)
class NodeContext:
    """What the node tells its strategy (and the strategy its communication modules) before the first step.

    rank / num_nodes: this node and how many there are (up or down). max_steps: the run's last step (an LR
    schedule's length). steps_per_epoch: one pass over the smallest node's shard, the same on every node.
    shard_size: examples in this node's training data per epoch (differs across nodes with unequal shards).
    shard_sizes / shard_steps: every node's shard_size, and its steps in one pass over its own shard, by rank
    (FedAvg weights by the first and runs E passes of the second; () where a run does not say).
    node_speeds: every node's compute speed by rank, relative (a step's seconds are inversely proportional to it: fit's
    node_speeds x device_flops, or node_speeds alone when compute time is measured); () without simulated time.
    share_parameters: whether the nodes' parameters may be views of one storage (DDP's one replica); False
    where the backend keeps each node's parameters itself (fused execution stacks them).
    keep_once(key, make): state that every node holds identically by construction (DDP's replica, DiLoCo's outer
    model, SPARTA's permutations), made once per process: the sim backend gives every node of the run the same
    object for a key; one node per process (torch.distributed) makes its own. `key` must be the same on every
    node (a value drawn in the strategy's __init__, which every node's copy shares).
    """

    rank: int
    num_nodes: int
    max_steps: int
    steps_per_epoch: int = 1
    shard_size: int = 0
    shard_sizes: tuple[int, ...] = ()
    shard_steps: tuple[int, ...] = ()
    node_speeds: tuple[float, ...] = ()
    share_parameters: bool = True
    keep_once: KeepOnce = field(default=keep_once_per_node, compare=False, repr=False)


def keep_once(owner: Any, key: Hashable, make: Callable[[], Any]) -> Any:
    """`make()` kept once through the node context of `owner` (a strategy or module bound to a node); made anew
    when `owner` is not bound to a running node."""
    context = getattr(owner, "context", None)
    return (keep_once_per_node if context is None else context.keep_once)(key, make)
