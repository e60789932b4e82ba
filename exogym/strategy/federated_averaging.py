"""FedAvg: local steps, then model averaging (McMahan et al., "Communication-Efficient Learning of Deep
Networks from Decentralized Data", AISTATS 2017), with islands and client sampling."""

from __future__ import annotations

from typing import Any

import torch

from exogym._validation import check_int
from exogym.strategy.communicate_optimize_strategy import AveragingCommunicator, ModularStrategy
from exogym.strategy.optim import OptimSpec

__all__ = ["FedAvgStrategy"]


class FedAvgStrategy(ModularStrategy):
    """FedAvg: every node takes H local steps (plain SGD by default), then the nodes' parameters are
    averaged (one all-reduce of the model) and every node continues from the average.

    Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data" (2017).
    Bytes per node per round: 2 (R-1)/R x the model's bytes, R = island_size or the nodes taking part;
    plus, with client sampling, the model once per node that joins the next round without this one.
    A node that drops keeps its local progress; the others average without it.

    island_size: each round the nodes are shuffled (shared seed) into islands that average only within.
    client_sampling=C: each round only max(1, round(C*K)) sampled nodes train and average; the others
        do no compute and send nothing (a 100-client run costs what its sampled clients do).
    local_epochs=E: a round is E passes over a node's shard (H = E x steps per epoch) instead of H steps.
    """

    _default_inner = OptimSpec(torch.optim.SGD, lr=0.01)

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 H: int | None = None, island_size: int | None = None, client_sampling: float = 1.0,
                 local_epochs: int | None = None, seed: int = 0, inner_optim: OptimSpec | str | type | None = None,
                 lr: float | None = None, weight_decay: float | None = None, **kwargs: Any):
        check_int("H", H, minimum=1, allow_none=True)
        check_int("local_epochs", local_epochs, minimum=1, allow_none=True)
        if H is not None and local_epochs is not None:
            raise TypeError(f"got both H={H!r} and local_epochs={local_epochs!r}; a round is either H steps or "
                            "local_epochs passes over the shard, pass one of them")
        super().__init__(optim_spec, max_norm, inner_optim=inner_optim, lr=lr, weight_decay=weight_decay, **kwargs)
        self._use_modules([AveragingCommunicator(1 if H is None else H, island_size=island_size,
                                                 client_sampling=client_sampling, seed=seed)])
        self.local_epochs = local_epochs

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        if self.local_epochs is not None:
            self.modules[0].H = self.local_epochs * self.steps_per_epoch
        super()._init_node(model, rank, num_nodes)

    @property
    def H(self) -> int:
        return self.modules[0].H
