"""Tiny models and helpers for the strategy tests: constant per-node gradients, per-node model handles."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from exogym import Trainer

FIT = dict(progress=False, device="cpu", logger=False, val_interval=10_000)

# Each node works on deep copies; a watched strategy records its node's model and itself here, by rank.
NODES: dict[int, tuple[torch.nn.Module, object]] = {}


def watched(strategy_cls: type) -> type:
    """A subclass of strategy_cls that records (model, strategy) of every node in NODES."""
    class Watched(strategy_cls):
        one_replica = getattr(strategy_cls, "one_replica", False)  # a pure observer: DDP keeps its own choice

        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            NODES[rank] = (model, self)
    Watched.__name__ = strategy_cls.__name__
    return Watched


def watched_module(module_cls: type) -> type:
    """A subclass of a CommunicationModule class that records (model, module) of every node in NODES."""
    class Watched(module_cls):
        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            NODES[rank] = (model, self)
    Watched.__name__ = module_cls.__name__
    return Watched


class Linear(torch.nn.Module):
    """loss = <w, mean of the batch's vectors>, so the gradient is exactly that mean: with a dataset of one
    repeated vector c, every step's gradient is c."""

    def __init__(self, init):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(init, dtype=torch.float32))

    def forward(self, batch):
        (c,) = batch
        return (self.w * c.mean(0)).sum()


def constant_gradients(grads: list[list[float]], n: int = 8):
    """A dataset factory giving node r the vector grads[r], n times."""
    return lambda rank, num_nodes, is_val: TensorDataset(torch.tensor([grads[rank]] * n, dtype=torch.float32))


def run_linear(strategy, grads: list[list[float]], init: list[float], steps: int) -> tuple[torch.nn.Module, Trainer]:
    """Train Linear(init) on len(grads) nodes for `steps` steps, node r's gradient always grads[r]."""
    NODES.clear()
    trainer = Trainer(Linear(init), constant_gradients(grads))
    model = trainer.fit(strategy, len(grads), batch_size=4, max_steps=steps, **FIT)
    return model, trainer


def node_params(rank: int) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in NODES[rank][0].parameters()])


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
