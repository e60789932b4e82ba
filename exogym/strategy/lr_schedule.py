"""Learning-rate schedules a strategy can attach to its optimizer."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["lambda_cosine", "build_lr_scheduler", "SCHEDULE_NAMES"]

SCHEDULE_NAMES = ("lambda_cosine",)


def lambda_cosine(*, warmup_steps: int, max_steps: int, cosine_anneal: bool, min_lr_factor: float) -> Callable[[int], float]:
    """LR factor for optimizer step `step` (0-based): linear warmup, then constant or cosine to min_lr_factor."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps  # the first step already trains (factor 1/warmup, not 0)
        if not cosine_anneal:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_lr_scheduler(spec: Any, optimizer: torch.optim.Optimizer, *, max_steps: int, warmup_steps: int,
                       cosine_anneal: bool, min_lr_factor: float, scheduler_kwargs: dict[str, Any]):
    """`spec` is "lambda_cosine", a torch LRScheduler class (built with scheduler_kwargs) or f(optimizer)."""
    if spec == "lambda_cosine":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_cosine(
            warmup_steps=warmup_steps, max_steps=max_steps, cosine_anneal=cosine_anneal, min_lr_factor=min_lr_factor))
    if isinstance(spec, type):
        return spec(optimizer, **scheduler_kwargs)
    return spec(optimizer)
