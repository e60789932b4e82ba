"""RunPlan: everything a backend needs to start the nodes of one validated run."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from exogym.data.sharding import NodeBatches
from exogym.node import RunConfig, TrainNode
from exogym.record import LiveLog
from exogym.rng import NodeRNG, node_seed

__all__ = ["RunPlan"]


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

    @property
    def num_nodes(self) -> int:
        return self.cfg.num_nodes

    def make_node(self, rank: int, start_time: float) -> TrainNode:
        # Each node trains its own copy of the model and the strategy; the user's objects stay untouched.
        return TrainNode(rank, copy.deepcopy(self.model), copy.deepcopy(self.strategy), self.node_batches[rank],
                         self.val_batches if rank == 0 else None, self.devices[rank], self.cfg, start_time, self.live)

    def node_rng(self, rank: int) -> NodeRNG:
        return NodeRNG(node_seed(self.seed, rank), self.devices[rank])
