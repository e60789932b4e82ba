"""The Strategy base class and SimpleReduceStrategy (DDP).

A strategy owns a node's optimizer(s) and decides when and what the nodes communicate.
Each node gets its own deep copy of the strategy the user passed; `_init_node` binds the
copy to that node's model.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from exogym._validation import check_number, init_keywords, reject_unknown_kwargs
from exogym.flatten import flatten_by_dtype, unflatten_into
from exogym.strategy.communicate import alive_ranks, all_reduce
from exogym.strategy.lr_schedule import LRSchedule
from exogym.strategy.optim import OptimSpec, ensure_optim_spec

__all__ = ["Strategy", "SimpleReduceStrategy"]


class Strategy:
    """Base class: LR schedule, gradient clipping, step counting, and the hooks a node calls.

    Subclasses set `self.optim_spec` in `__init__` (then `self.optim` is built for them in
    `_init_node`) or build their own optimizer in `_init_node`, and implement `step()`,
    ending with `super().step()`.

    lr_scheduler: None, "lambda_cosine" (linear warmup, then constant or cosine decay to
        min_lr_factor x lr; setting warmup_steps or cosine_anneal selects it), a torch
        LRScheduler class built with lr_scheduler_kwargs, or a callable f(optimizer).
    max_norm: clip the global gradient norm of the node's parameters before each step.
    """

    identical_replicas = False  # True: every node holds the same model after each step (DDP), so a joiner copies one
    supports_membership_changes = True  # False: the strategy cannot run with failures or an elastic pool

    max_steps: int  # set by the node before _init_node (the schedule needs the run length)
    steps_per_epoch: int  # likewise: steps in one pass over the smallest node's shard, equal on every node
    shard_size: int  # likewise: examples in this node's training data per epoch (differs across nodes)

    def __new__(cls, *args: Any, **kwargs: Any):
        # Keep the constructor arguments, so a run's config.json can say exactly how the strategy was built.
        self = super().__new__(cls)
        self._init_args = (args, kwargs)
        return self

    def config(self) -> dict[str, Any]:
        """The constructor arguments (given and default) this strategy was built with."""
        args, kwargs = getattr(self, "_init_args", ((), {}))
        bound = inspect.signature(type(self).__init__).bind_partial(self, *args, **kwargs)
        bound.apply_defaults()
        out: dict[str, Any] = {"name": type(self).__name__}
        for name, value in list(bound.arguments.items())[1:]:
            if isinstance(value, dict) and bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out

    def __init__(self, lr_scheduler: str | type | Callable[..., Any] | None = None,
                 lr_scheduler_kwargs: Mapping[str, Any] | None = None, *, warmup_steps: int | None = None,
                 cosine_anneal: bool | None = None, min_lr_factor: float | None = None,
                 max_norm: float | None = None, **unknown: Any):
        reject_unknown_kwargs(type(self).__name__, unknown, init_keywords(type(self)))
        self.lr_schedule = LRSchedule.parse(lr_scheduler, lr_scheduler_kwargs, warmup_steps=warmup_steps,
                                            cosine_anneal=cosine_anneal, min_lr_factor=min_lr_factor)
        check_number("max_norm", max_norm, positive=True, allow_none=True)
        self.max_norm = max_norm
        self.scheduler = None

    # ---- called by the node ------------------------------------------------------------------
    def _init_node(self, model: torch.nn.Module, rank: int, num_nodes: int) -> None:
        self.model, self.rank, self.num_nodes = model, rank, num_nodes
        self.local_step = 0
        if getattr(self, "optim_spec", None) is not None:
            self.optim_spec = ensure_optim_spec(self.optim_spec)
            self.optim = self.optim_spec.build(model)

    def _finish_init(self) -> None:
        """Attach the LR schedule to whatever optimizer `_init_node` left in `self.optim`."""
        if self.lr_schedule is not None and self.scheduler is None:
            if getattr(self, "optim", None) is None:
                raise TypeError(f"{type(self).__name__} has an lr_scheduler but no self.optim after _init_node; "
                                "set self.optim_spec in __init__ or build self.optim in _init_node")
            self.scheduler = self.lr_schedule.build(self.optim, max_steps=getattr(self, "max_steps", 1))

    def zero_grad(self) -> None:
        self.optim.zero_grad()

    def skip_compute(self) -> bool:
        """True: this node sits out the coming step (no data to the device, no forward, no backward;
        FedAvg's unsampled clients). The node still calls step(), which must still join whatever
        collectives the step's schedule has. Asked once per step, before zero_grad(); no collectives here."""
        return False

    def step(self) -> None:
        """Subclasses communicate and update, then call this: it advances the LR schedule and the step count."""
        if self.scheduler is not None:
            self.scheduler.step()
        self.local_step += 1

    def _current_lr(self) -> float:
        """The learning rate of the node's (inner) optimizer for its next step."""
        optim = getattr(self, "optim", None)
        return float(optim.param_groups[0]["lr"]) if optim is not None else float("nan")

    def global_state(self) -> Mapping[str, torch.Tensor] | None:
        """State-dict entries that define the global model and are equal on every node.

        None (the default): the global model is the average of the nodes' models. A strategy
        with its own global model (DiLoCo's outer parameters) returns those entries; the rest
        are still averaged.
        """
        return None

    # ---- nodes coming up (failures, elastic pools; exogym.rejoin) ------------------------------
    def _model_sources(self, survivors: list[int], steps_done: int) -> list[int]:
        """The nodes, among those up at the step before, whose models define the global model a joiner gets
        after `steps_done` steps: all of them (averaged), or one when every replica is the same. Called on
        every node up (a joiner's own step count is stale until it loads the survivors' state)."""
        return survivors[:1] if self.identical_replicas else survivors

    @torch.no_grad()
    def _state_for_joiners(self, sources: list[int]) -> dict[str, Any]:
        """Every node of `sources` calls this together; the first one's result is sent to the nodes coming up:
        the global model (the average over `sources`, one all-reduce among them), and the first source's
        optimizer, schedule and step count. Subclasses add their own state (and extend the loader)."""
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if len(sources) > 1:
            for flat, tensors in flatten_by_dtype(v for v in model.values() if v.is_floating_point()):
                all_reduce(flat, group=sources)
                flat.div_(len(sources))
                unflatten_into(flat, tensors)
        optim = getattr(self, "optim", None)
        return {"model": model, "optim": optim.state_dict() if optim is not None else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "local_step": self.local_step}

    @torch.no_grad()
    def _load_state_from_survivor(self, state: dict[str, Any]) -> None:
        """On a node coming up: take the state `_state_for_joiners` made."""
        self.model.load_state_dict(state["model"])
        if state["optim"] is not None:
            self.optim.load_state_dict(state["optim"])
        if state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.local_step = state["local_step"]

    # ---- helpers for subclasses --------------------------------------------------------------
    def _clip_grads(self) -> None:
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)


class SimpleReduceStrategy(Strategy):
    """DDP: every step, gradients are averaged across all nodes (one all-reduce of all of them), then
    every node takes the same optimizer step, so the nodes' models stay identical.
    Sends 2·(K-1)/K x the model's gradient bytes per node per step (ring all-reduce).
    With failures or an elastic pool, the gradients are averaged over the nodes that are up.
    """

    identical_replicas = True

    def __init__(self, optim_spec: OptimSpec | str | type | None = None, max_norm: float | None = None, *,
                 lr: float | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        check_number("lr", lr, positive=True, allow_none=True)
        self.optim_spec = ensure_optim_spec(optim_spec, OptimSpec(torch.optim.AdamW, lr=1e-3), lr=lr)

    def step(self) -> None:
        up = len(alive_ranks()) if self.num_nodes > 1 else 1
        if up > 1:
            # One bucket per dtype: one collective per step instead of one per parameter.
            for flat, grads in flatten_by_dtype(p.grad for p in self.model.parameters() if p.grad is not None):
                all_reduce(flat)
                flat.div_(up)
                unflatten_into(flat, grads)
        self._clip_grads()
        self.optim.step()
        super().step()
