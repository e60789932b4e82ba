"""The one minibatch loop every forward/backward goes through: a node's own, the fused engine's batched one, and
the probe that times them.

Each minibatch's mean loss is weighted by its share of the batch, so the accumulated gradient equals the whole
batch's (for a model returning a mean over examples), and so do the loss and metrics returned.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from exogym.data.sharding import batch_size_of, split_batch

__all__ = ["minibatches", "accumulate"]

# step(i, weight) runs minibatch i's forward and backward (its loss scaled by `weight`; None: the whole batch in one
# piece, unscaled) and returns its unscaled loss and metrics.
MinibatchStep = Callable[[int, "float | None"], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def minibatches(batch: Any, minibatch_size: int) -> list[Any]:
    """The batch in pieces of minibatch_size examples; the batch itself when it is no larger."""
    return [batch] if minibatch_size >= batch_size_of(batch) else split_batch(batch, minibatch_size)


def accumulate(parts: list[Any], step: MinibatchStep) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run `step` over the minibatches `parts` (minibatches' result); return the batch's loss (detached) and
    metrics, each minibatch's weighted by its share of the batch."""
    if len(parts) == 1:
        loss, metrics = step(0, None)
        return loss.detach(), metrics
    sizes = [batch_size_of(p) for p in parts]
    n = sum(sizes)
    total, totals = None, {}
    for i, size in enumerate(sizes):
        w = size / n
        loss, metrics = step(i, w)
        total = loss.detach() * w if total is None else total + loss.detach() * w
        for k, v in metrics.items():
            totals[k] = v * w + totals.get(k, 0.0)
    return total, totals
