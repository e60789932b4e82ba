"""RunPlan: everything a backend needs to start the nodes of one validated run (data only, sent to every process);
RunSinks: where one process's nodes report while they run (process-local, never sent)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from exogym.runs.checkpoint import CheckpointPlan, NodeState
from exogym.data.sharding import NodeBatches, keep_rows_read
from exogym.engine.config import RunConfig
from exogym.engine.execution import Execution
from exogym.engine.node import TrainNode
from exogym.engine.rng import GlobalRNGState, NodeRNG, NumpyBaton, node_seed
from exogym.strategy.context import KeepOnce, keep_once_per_node

__all__ = ["RunPlan", "RunSinks", "RowSink"]


class RowSink(Protocol):
    """Where a node's rows go while it runs: the run's LiveLog in the caller, or a process's pipe to it."""

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None: ...

    def add_row(self, table: str, row: dict[str, float]) -> None: ...


@dataclass
class RunSinks:
    """Where the nodes of one process report while they run; made in that process, never pickled.

    Attributes:
        live: the nodes' rows (every 10 steps, and when the run stops): the run's LiveLog in the caller, a
            forwarder to it in a launched process.
        on_stuck: called (from the sim's watchdog thread) with the NodeTimeoutError when a node stays stuck in
            native code past node_timeout and a grace period; the process then exits
            (exogym.backends.sim.watchdog). None: the message goes to stderr only.
    """

    live: RowSink
    on_stuck: Callable[[BaseException], None] | None = None


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
    checkpoints: CheckpointPlan | None = None
    resume: list[NodeState] | None = None  # per node, from load_checkpoint
    node_timeout: float | None = None  # seconds a node may run without progress (fit's node_timeout); None: no limit
    peer_timeout: float | None = None  # seconds a process may go without a heartbeat (fit's peer_timeout); None: never
    execution: str = "sequential"  # or "fused" (sim backend: one batched forward/backward, exogym.backends.sim.fused)

    @property
    def num_nodes(self) -> int:
        return self.cfg.num_nodes

    def for_nodes(self, nodes: Sequence[int]) -> "RunPlan":
        """The plan as a process hosting `nodes` needs it: those nodes' batches holding only the examples they read
        in this run (exogym.data.sharding.keep_rows_read), their checkpointed states, and the validation batches
        where node 0 is among them; the other nodes' entries are None. The plan itself is untouched.

        Args:
            nodes: the ranks the process hosts.

        Returns:
            A plan to send to that process.
        """
        mine = set(nodes)
        start = {r: self.resume[r].step if self.resume is not None else 0 for r in mine}
        return dataclasses.replace(
            self, node_batches=[keep_rows_read(nb, start[r], self.cfg.max_steps) if r in mine else None
                                for r, nb in enumerate(self.node_batches)],
            val_batches=self.val_batches if 0 in mine else None,
            resume=None if self.resume is None else [s if r in mine else None for r, s in enumerate(self.resume)])

    def make_node(self, rank: int, start_time: float, live: RowSink, *, execution: Execution | None = None,
                  keep_once: KeepOnce = keep_once_per_node) -> TrainNode:
        # Each node trains its own copy of the model and the strategy (a resumed node then loads its saved
        # state into them); the user's objects stay untouched.
        state = self.resume[rank] if self.resume is not None else None
        model, strategy = copy.deepcopy(self.model), copy.deepcopy(self.strategy)
        return TrainNode(rank, model, strategy, self.node_batches[rank], self.val_batches if rank == 0 else None,
                         self.devices[rank], self.cfg, start_time, live, resume=state,
                         checkpoints=self.checkpoints, execution=execution, keep_once=keep_once)

    def node_rng(self, rank: int, baton: NumpyBaton | None = None) -> NodeRNG:
        """Node `rank`'s streams; `baton`: shared by the nodes that hand over to one another (the sim)."""
        state = GlobalRNGState.from_plain(self.resume[rank].rng) if self.resume is not None else None
        return NodeRNG(node_seed(self.seed, rank), self.devices[rank], state, baton)
