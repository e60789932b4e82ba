"""What a server hands a node with each global model: its next task (how many inner steps, on which data shard).

The asynchronous Local-SGD framework (Liu, Chhaparia, Douillard et al., "Asynchronous Local-SGD Training for
Language Modeling", arXiv:2401.09135) gives every worker a task at a time: a number of inner steps and a data shard,
sampled by the server so that shards are visited evenly although fast workers take more tasks. Here:

- `ShardSampler`: the shard of each task (`"least_visited"`, the accompanying toy simulator's rule, or
  `"undersampled"`, the paper's eq. 2 as read here), and where in that shard's stream of batches the task starts.
- `speed_steps`: Dynamic Local Updates from the nodes' given speeds (the paper's eq. 6).
- `ShardReader`: a node's batches for its current task, read from the task's shard.
- `ShardLR`: the inner learning rate of a step, from its shard's own schedule (each shard's cosine over its own
  total steps, as the framework has), not from the node's step count.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Mapping

import torch

__all__ = ["SHARD_SAMPLING", "ShardSampler", "speed_steps", "ShardReader", "ShardLR"]

SHARD_SAMPLING = ("least_visited", "undersampled")


def speed_steps(H: int, speeds: list[float], min_steps: int) -> list[int]:
    """Dynamic Local Updates from given speeds (Liu et al. 2024, eq. 6): H_i = floor(H v_i / max_j v_j), at least
    `min_steps` (the paper leaves the floor open; 1 keeps every node training, the toy simulator used 5).

    Args:
        H: The fastest node's inner steps.
        speeds: Each node's speed (steps per second, or any multiple of it).
        min_steps: The fewest steps a node is given.

    Returns:
        Each node's inner steps per task.
    """
    fastest = max(speeds)
    return [max(min_steps, math.floor(H * v / fastest)) for v in speeds]


class ShardSampler:
    """Which shard each task reads, and from which position of that shard's stream of batches.

    Shard s is node s's shard of the training data (as without sampling); its batches form one stream that every
    task on it continues (position = the steps handed out on it so far), as the toy simulator reads its shards.
    A task's steps count against its shard when it is handed out, whether or not the node takes them all.

    Rules:
        least_visited: a shard with the fewest tasks so far, ties drawn uniformly (the toy simulator's rule).
        undersampled: shard s with probability proportional to max(0, n_s / N - u_s / U), its share of the data
            less its share of the steps handed out so far (U of them; n_s its examples of N): the paper's eq. 2 as
            read here, "sample a shard in proportion to how far it is under-sampled". When no shard is under its
            share (U = 0, or all exactly at it), uniformly.

    The first task of node r is on shard r (every node starts at once, before the server has seen any), from
    position 0; the server samples every later one.

    Args:
        rule: "least_visited" or "undersampled".
        sizes: Each shard's examples (its share of the data); equal shards where unknown.
        first_steps: Node r's first task's steps, by rank.
        seed: The seed of the draws.
    """

    def __init__(self, rule: str, sizes: list[int], first_steps: list[int], seed: int):
        self.rule = rule
        self.sizes = [float(n) for n in sizes]
        self.visits = [1] * len(sizes)
        self.handed = list(first_steps)  # steps handed out on each shard: its next task starts there
        self.gen = torch.Generator().manual_seed(seed)

    def assign(self, steps: int) -> tuple[int, int]:
        """The next task's shard and the position in it where the task starts; counts the task against it.

        Args:
            steps: The task's inner steps.

        Returns:
            (shard, position).
        """
        weights = self._weights()
        shard = int(torch.multinomial(weights, 1, generator=self.gen))
        start = self.handed[shard]
        self.visits[shard] += 1
        self.handed[shard] += steps
        return shard, start

    def _weights(self) -> torch.Tensor:
        if self.rule == "least_visited":
            fewest = min(self.visits)
            return torch.tensor([1.0 if v == fewest else 0.0 for v in self.visits], dtype=torch.float64)
        total_data, total_steps = sum(self.sizes), sum(self.handed)
        under = [max(0.0, n / total_data - (u / total_steps if total_steps else 0.0))
                 for n, u in zip(self.sizes, self.handed)]
        if total_steps == 0 or sum(under) == 0:
            under = [1.0] * len(under)
        return torch.tensor(under, dtype=torch.float64)

    def state_dict(self) -> dict[str, Any]:
        return {"visits": list(self.visits), "handed": list(self.handed), "gen": self.gen.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.visits, self.handed = list(state["visits"]), list(state["handed"])
        self.gen.set_state(state["gen"])


class ShardReader:
    """A node's batches for its current task: batch after batch of the task's shard, from the task's position.

    The node draws one batch per step (an iterator the engine calls); `start(shard, position)` begins a task. A
    task reads consecutive positions, so one iterator per task serves it.

    Args:
        of_shard: The node's batches of shard s (exogym.data.sharding.NodeBatches.of_shard).
        shard: The first task's shard.
        position: The first task's first position in it.
    """

    def __init__(self, of_shard: Callable[[int], Any], shard: int, position: int):
        self._of_shard = of_shard
        self._shards: dict[int, Any] = {}
        self.start(shard, position)

    def start(self, shard: int, position: int) -> None:
        """Begin a task on `shard` at `position`."""
        self.shard, self.position = shard, position
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> "ShardReader":
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            if self.shard not in self._shards:
                self._shards[self.shard] = self._of_shard(self.shard)
            self._batches = self._shards[self.shard].iterate(from_step=self.position)
        self.position += 1
        return next(self._batches)


class ShardLR:
    """The inner optimizer's learning rate from its task's shard: the step at position p of shard s gets
    lr x factor(p), factor a schedule over the shard's own total steps (each shard's cosine, as the framework has;
    the node's own step count does not enter). Stands where a Strategy keeps its LR scheduler (`step()`,
    `state_dict()`), so the strategy's step and checkpoints go on as with any scheduler.

    Args:
        optimizer: The inner optimizer (its param groups' lr is set before each step).
        factor: factor(p) for position p, e.g. exogym.strategy.lr_schedule.lambda_cosine over the shard's steps.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float]):
        self.optimizer, self.factor = optimizer, factor
        self.base = [group["lr"] for group in optimizer.param_groups]
        self.at(0)

    def at(self, position: int) -> None:
        """Set the lr for the step at `position` of the current task's shard."""
        for group, lr in zip(self.optimizer.param_groups, self.base):
            group["lr"] = lr * self.factor(position)

    def step(self) -> None:
        """The strategy sets the next step's lr itself (`at`), from the shard's position."""

    def state_dict(self) -> dict[str, Any]:
        return {"base": list(self.base)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.base = list(state["base"])
