"""SimpleReduceStrategy: DDP, every node averages its gradients with the others' every step."""

from __future__ import annotations

import uuid
from typing import Any, Mapping

import torch

from exogym._validation import check_number
from exogym.comm.collectives import alive_ranks
from exogym.comm.mean import start_mean
from exogym.strategy.base import Strategy, parameter_state, strategy_keywords
from exogym.strategy.context import NodeContext
from exogym.strategy.optim import OptimSpec, ensure_optim_spec, pop_optimizer_options
from exogym.strategy.replica import Replica, replica_for

__all__ = ["SimpleReduceStrategy"]


class SimpleReduceStrategy(Strategy):
    """DDP: every step, gradients are averaged across all nodes (one all-reduce of all of them), then
    every node takes the same optimizer step, so the nodes' models stay identical.
    Sends 2·(K-1)/K x the model's gradient bytes per node per step (ring all-reduce).
    With failures or an elastic pool, the gradients are averaged over the nodes that are up.

    Memory: since every node holds the same parameters and optimizer state after every step, the nodes a backend
    runs in one process keep one replica of them (exogym.strategy.replica): each node's parameters are views of
    it, and the averaged update is applied once. That is this class's own step. `one_replica` says whether a
    class keeps it: True here, False for every subclass unless the subclass sets it again (a subclass that changes
    how a node steps must keep each node's own copy). A subclass whose _init_node builds its own optimizer keeps
    each node's copy whatever it says.
    """

    one_replica = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "one_replica" not in cls.__dict__:
            cls.one_replica = False  # an explicit choice of the subclass's author, never inherited by accident

    global_keys = frozenset({"optim"})  # the same gradients, the same optimizer steps, on every node

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 lr: float | None = None, **kwargs: Any):
        default = OptimSpec(torch.optim.AdamW, lr=1e-3)
        # The name form's options ("sgd", momentum=0.9) are the optimizer's; the rest are the base class's.
        options = pop_optimizer_options(type(self).__name__, optim_spec, default, kwargs, strategy_keywords(type(self)))
        super().__init__(max_norm=max_norm, **kwargs)
        check_number("lr", lr, positive=True, allow_none=True, finite=True)
        self.optim_spec = ensure_optim_spec(optim_spec, default, lr=lr, **options)
        self._replica_key = uuid.uuid4().hex  # every node's copy of this strategy shares it: one replica

    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        if not self._keeps_one_replica():
            super()._init_node(model, rank, num_nodes)
            self.replica = None
            return
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        self.local_step = 0
        self.optim_spec = ensure_optim_spec(self.optim_spec)
        self.replica = replica_for(self.context.keep_once, self._replica_key, model, lambda: Replica(
            model, self.optim_spec, self.lr_schedule, self.context.max_steps))
        self.replica.attach(model)
        self.optim, self.scheduler = self.replica.optim, self.replica.scheduler
        self._next_lr = float(self.optim.param_groups[0]["lr"])

    def setup(self, model: torch.nn.Module, context: NodeContext) -> None:
        super().setup(model, context)
        if self.replica is not None and self.optim is not self.replica.optim:
            # A subclass's _init_node built its own optimizer: each node then steps its own copy.
            for p in model.parameters():
                p.data = p.data.clone()
            self.replica = None
            if self.scheduler is not None and self.scheduler.optimizer is not self.optim:
                self.scheduler = self.lr_schedule.build(self.optim, max_steps=context.max_steps)

    def _keeps_one_replica(self) -> bool:
        """One replica for all nodes when the class says so and the backend lets nodes share parameter storage
        (not under fused execution, whose stacked parameters are every node's own)."""
        return self.one_replica and self.context.share_parameters and getattr(self, "optim_spec", None) is not None

    def step(self) -> None:
        if self.replica is None:
            self.communicate_gradients()  # one bucket per dtype: one collective per step instead of one per parameter
            self.update_parameters()
            super().step()
            return
        params = list(self.model.parameters())
        has_grad = [p.grad is not None for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        for p in params:  # the node's own: handed to the mean (or, alone, to the update); zero_grad is the replica's
            p.grad = None
        if self.num_nodes > 1 and len(alive_ranks()) > 1:
            grads = start_mean(grads, consume=True).wait()  # the mean drops them once copied: waiting nodes hold none
        mean = iter(grads)
        self.replica.apply_once(self.local_step, [next(mean) if h else None for h in has_grad], self._update)
        self.local_step += 1  # the replica stepped the LR schedule (once, not once per node)
        self._next_lr = float(self.optim.param_groups[0]["lr"])
        self._lr_stepped()

    def _update(self, params: list[torch.nn.Parameter]) -> None:
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        self.optim.step()

    def current_lr(self) -> float:
        if self.replica is None:
            return super().current_lr()
        return self._next_lr  # this node's: a node that is down keeps the rate of its last step

    def load_state_dict(self, state: Mapping[str, Mapping[str, Any]]) -> None:
        super().load_state_dict(state)  # into the one replica's optimizer and schedule (the same on every node)
        if self.replica is not None:
            self.replica.steps_applied = self.local_step
            self._next_lr = float(self.optim.param_groups[0]["lr"])

    def global_state(self) -> Mapping[str, torch.Tensor]:
        return parameter_state(self.model)  # every replica holds the same parameters
