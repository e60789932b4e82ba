"""RunPlan: everything a backend needs to start the nodes of one validated run."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from exogym.checkpoint import CheckpointPlan, NodeState
from exogym.data.sharding import NodeBatches
from exogym.membership import Membership
from exogym.node import TrainNode
from exogym.record import LiveLog
from exogym.rng import NodeRNG, NumpyBaton, node_seed
from exogym.simtime import TimeModel

__all__ = ["RunConfig", "RunPlan"]


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


@dataclass
class RunPlan:
    """Built once by `Trainer.fit` after validation; a backend turns it into running nodes.

    Backends call `make_node(rank, start_time)` on whichever thread or process runs that node,
    and `node_rng(rank)` to give the node its own random streams.
    """

    model: torch.nn.Module
    strategy: Any
    node_batches: list[NodeBatches]
    val_batches: list[Any] | None
    devices: list[torch.device]
    cfg: RunConfig
    seed: int
    live: LiveLog  # the sim shares one across nodes; a torch.distributed process keeps its own
    checkpoints: CheckpointPlan | None = None
    resume: list[NodeState] | None = None  # per node, from load_checkpoint
    node_timeout: float | None = None  # seconds a node may run without progress (fit's node_timeout); None: no limit
    port: int | None = None  # backend='torch' spawned by fit: the rendezvous port (None: a free one)
    execution: str = "sequential"  # or "fused" (sim backend: one batched forward/backward, exogym.fused)

    @property
    def num_nodes(self) -> int:
        return self.cfg.num_nodes

    def make_node(self, rank: int, start_time: float) -> TrainNode:
        # Each node trains its own copy of the model and the strategy (a resumed node then loads its saved
        # state into them); the user's objects stay untouched.
        state = self.resume[rank] if self.resume is not None else None
        model, strategy = copy.deepcopy(self.model), copy.deepcopy(self.strategy)
        return TrainNode(rank, model, strategy, self.node_batches[rank], self.val_batches if rank == 0 else None,
                         self.devices[rank], self.cfg, start_time, self.live, resume=state,
                         checkpoints=self.checkpoints)

    def node_rng(self, rank: int, baton: NumpyBaton | None = None) -> NodeRNG:
        """Node `rank`'s streams; `baton`: shared by the nodes that hand over to one another (the sim)."""
        state = self.resume[rank].rng if self.resume is not None else None
        return NodeRNG(node_seed(self.seed, rank), self.devices[rank], state, baton)
