"""RunConfig: the numbers every node of one run shares."""

from __future__ import annotations

from dataclasses import dataclass

from exogym.cluster.membership import Membership
from exogym.cluster.simtime import TimeModel

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    """The numbers every node of one run shares (validated and derived by the trainer)."""

    num_nodes: int
    max_steps: int
    batch_size: int
    minibatch_size: int
    val_interval: int
    log_interval: int
    autocast: bool
    validate: bool  # every node takes part in building the global model, node 0 evaluates it
    diagnostics_interval: int | None = None
    time_model: TimeModel | None = None  # None: no simulated time
    steps_per_epoch: int = 1  # the run's: one pass over the smallest node's shard
    shard_sizes: tuple[int, ...] = ()  # every node's examples per epoch, by rank (FedAvg weights by them)
    shard_steps: tuple[int, ...] = ()  # every node's steps in one pass over its own shard, by rank
    membership: Membership | None = None  # failures / elastic pool: who is up at each step; None: everyone
