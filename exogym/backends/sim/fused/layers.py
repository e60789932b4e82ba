"""Forwards that vmap batches well: the engine's template runs its nn.Linear layers through `batched_linear`.

Under vmap, F.linear(x, W) becomes bmm(x, W^T), and autograd hands the weight's gradient back as the
transpose of a contiguous [K, in, out] tensor. Every elementwise op of the optimizer then walks it strided,
or one copy per step puts it in the parameter's layout: with that copy the 784-256-256-10 MLP's batched
forward/backward (32 rows per node) took 2.1x (8 nodes) and 2.2x (32 nodes) the time it takes below
(benchmarks/bench_fused_parts.py). Written as (W x^T)^T, the same products give the weight gradient
as bmm(dy^T, x), already in the parameter's layout, and the transposes fall on the activations instead: the
layer's output and its input's gradient come out strided, and the elementwise ops around them walk them so.
That pays where those two are smaller than the weight, rows x (in + out) <= in x out (small per-node batches:
the MLP's first two layers); elsewhere (a GPT's 512 tokens per node, where a strided GELU gradient cost 1.6x)
the layer keeps F.linear. Either way the products are the same, only summed in another order (float rounding).
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn.functional as F

__all__ = ["batching_friendly", "batched_linear"]


def batched_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward; under vmap, in the form whose weight gradient needs no transposing copy."""
    rows = x.numel() // x.shape[-1] if x.dim() else 1
    if rows * (self.in_features + self.out_features) > self.in_features * self.out_features:
        return F.linear(x, self.weight, self.bias)
    x2 = x.reshape(rows, self.in_features)
    y = self.weight @ x2.mT if self.bias is None else torch.addmm(self.bias.unsqueeze(-1), self.weight, x2.mT)
    return y.mT.reshape(*x.shape[:-1], self.out_features)


def batching_friendly(template: torch.nn.Module) -> torch.nn.Module:
    """A copy of `template` sharing its tensors, whose plain nn.Linear layers (not subclasses, which may have a
    forward of their own) compute with `batched_linear`. The copy is only ever run under functional_call."""
    shared = {id(t): t for t in (*template.parameters(), *template.buffers())}
    out = copy.deepcopy(template, memo=shared)
    for m in out.modules():
        if type(m) is torch.nn.Linear:
            m.forward = types.MethodType(batched_linear, m)
    return out
