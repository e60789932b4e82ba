"""Learning-rate schedules a strategy attaches to its (inner) optimizer."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from exogym._validation import check_int, check_number, reject_unknown_kwargs

__all__ = ["lambda_cosine", "LRSchedule"]

_COSINE_KEYS = ("warmup_steps", "cosine_anneal", "min_lr_factor")


@dataclass(frozen=True)
class lambda_cosine:  # noqa: N801 - a function in use; a class so that checkpoints can pickle it
    """LR factor for optimizer step `step` (0-based): linear warmup, then constant or cosine to min_lr_factor."""

    warmup_steps: int
    max_steps: int
    cosine_anneal: bool
    min_lr_factor: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps  # the first step already trains (factor 1/warmup, not 0)
        if not self.cosine_anneal:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class LRSchedule:
    """What the user asked for, validated: "lambda_cosine" with its three knobs, a torch LRScheduler
    class with its keyword arguments, or a callable f(optimizer) -> scheduler."""

    kind: str | type | Callable[..., Any]
    warmup_steps: int = 0
    cosine_anneal: bool = False
    min_lr_factor: float = 0.1
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, lr_scheduler: Any, lr_scheduler_kwargs: Mapping[str, Any] | None,
              **cosine: Any) -> "LRSchedule | None":
        """Both documented spellings work: warmup_steps=... as an argument or inside lr_scheduler_kwargs."""
        kwargs = dict(lr_scheduler_kwargs or {})
        for name, value in cosine.items():
            if value is not None:
                if name in kwargs:
                    raise TypeError(f"{name} was given both as an argument and in lr_scheduler_kwargs; give it once")
                kwargs[name] = value
        if lr_scheduler is None:
            if not kwargs:
                return None
            if not set(kwargs) <= set(_COSINE_KEYS):
                raise TypeError(f"lr_scheduler_kwargs {sorted(kwargs)} were given without an lr_scheduler")
            lr_scheduler = "lambda_cosine"  # warmup_steps=... alone asks for it
        if isinstance(lr_scheduler, str):
            if lr_scheduler != "lambda_cosine":
                raise ValueError(f"unknown lr_scheduler {lr_scheduler!r}; use 'lambda_cosine' (or, as strategy "
                                 "arguments, 'cosine' and 'constant'), a torch.optim.lr_scheduler class, or a "
                                 "callable f(optimizer)")
            reject_unknown_kwargs("lr_scheduler='lambda_cosine'", {k: v for k, v in kwargs.items()
                                                                   if k not in _COSINE_KEYS}, _COSINE_KEYS)
            spec = cls("lambda_cosine", warmup_steps=kwargs.get("warmup_steps", 0),
                       cosine_anneal=kwargs.get("cosine_anneal", False), min_lr_factor=kwargs.get("min_lr_factor", 0.1))
            check_int("warmup_steps", spec.warmup_steps, minimum=0)
            check_number("min_lr_factor", spec.min_lr_factor, minimum=0.0, maximum=1.0)
            if not isinstance(spec.cosine_anneal, bool):
                raise TypeError(f"cosine_anneal must be True or False, got {spec.cosine_anneal!r}")
            return spec
        if inspect.isclass(lr_scheduler):
            if not issubclass(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
                raise TypeError(f"lr_scheduler class must subclass torch.optim.lr_scheduler.LRScheduler, "
                                f"got {lr_scheduler.__name__}")
            params = inspect.signature(lr_scheduler.__init__).parameters
            accepted = [p for p in params if p not in ("self", "optimizer")]
            if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                reject_unknown_kwargs(f"lr_scheduler={lr_scheduler.__name__}",
                                      {k: v for k, v in kwargs.items() if k not in accepted}, accepted)
            return cls(lr_scheduler, kwargs=kwargs)
        if callable(lr_scheduler):
            if kwargs:
                raise TypeError(f"lr_scheduler_kwargs {sorted(kwargs)} cannot be passed to a callable lr_scheduler; "
                                "bind them inside the callable")
            return cls(lr_scheduler)
        raise TypeError(f"lr_scheduler must be 'lambda_cosine', a torch LRScheduler class or a callable, "
                        f"got {lr_scheduler!r}")

    def build(self, optimizer: torch.optim.Optimizer, *, max_steps: int):
        if self.kind == "lambda_cosine":
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_cosine(
                warmup_steps=self.warmup_steps, max_steps=max_steps, cosine_anneal=self.cosine_anneal,
                min_lr_factor=self.min_lr_factor))
        if inspect.isclass(self.kind):
            return self.kind(optimizer, **self.kwargs)
        return self.kind(optimizer)
