"""Attention under vmap: scaled_dot_product_attention with the node dimension folded into the batch.

torch has no vmap batching rule for the CPU SDPA kernel (vmap would loop over the nodes one by
one and warn). Attention holds no parameters, so K nodes' attention over [B, H, T, D] inputs is
exactly one attention over [K*B, H, T, D]: `fold_attention()` routes F.scaled_dot_product_attention
calls made under vmap to an autograd.Function whose vmap rule does that fold and calls the CPU
flash kernel and its backward directly (no recomputation). Calls it cannot fold (dropout_p > 0,
an attn_mask, grouped-query attention, inputs other than 4-D) take the same formula written as
matmul/softmax/dropout, which vmap batches natively; with dropout its masks come from vmap's
random stream (see exogym.backends.sim.fused.engine).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["fold_attention", "math_attention"]

_sdpa = F.scaled_dot_product_attention


def math_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q k^T * scale + mask) v, with dropout on the weights: SDPA's definition, in batchable ops."""
    L, S = q.shape[-2], k.shape[-2]
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    att = (q @ k.transpose(-2, -1)) * scale  # [..., L, S]
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        att = att.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else att + attn_mask
    att = torch.softmax(att, dim=-1)
    if dropout_p > 0:
        att = F.dropout(att, p=dropout_p, training=True)
    return att @ v


class _FoldedFlashAttention(torch.autograd.Function):
    """The CPU flash-attention kernel as an autograd.Function, so that it can carry a vmap rule."""

    @staticmethod
    def forward(q, k, v, is_causal, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        return out, lse

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, is_causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.mark_non_differentiable(lse)

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, ctx.is_causal, scale=ctx.scale)
        return gq, gk, gv, None, None

    @staticmethod
    def vmap(info, in_dims, q, k, v, is_causal, scale):
        # [N, B, H, T, D] -> [N*B, H, T, D]: one call for all N nodes (inputs without the dim are expanded).
        n = info.batch_size

        def fold(t, d):
            t = t.unsqueeze(0).expand(n, *t.shape) if d is None else t.movedim(d, 0)
            return t.reshape(n * t.shape[1], *t.shape[2:])

        out, lse = _FoldedFlashAttention.apply(fold(q, in_dims[0]), fold(k, in_dims[1]), fold(v, in_dims[2]),
                                               is_causal, scale)
        return (out.unflatten(0, (n, -1)), lse.unflatten(0, (n, -1))), (0, 0)


def _foldable(q, k, v, attn_mask, dropout_p, enable_gqa) -> bool:
    return (q.device.type == "cpu" and attn_mask is None and dropout_p == 0.0 and not enable_gqa
            and q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16))


def _attention_under_vmap(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if q.device.type != "cpu" and dropout_p == 0.0:
        return _sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if _foldable(q, k, v, attn_mask, dropout_p, enable_gqa):
        if torch.is_autocast_enabled("cpu"):  # SDPA runs in the autocast dtype; so does the kernel here
            dtype = torch.get_autocast_dtype("cpu")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return _FoldedFlashAttention.apply(q, k, v, bool(is_causal), scale)[0]
    return math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


class fold_attention(TorchFunctionMode):
    """Within this mode, F.scaled_dot_product_attention batches over vmap's node dimension (see above).
    `called` says whether the mode has seen an attention call."""

    called = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is _sdpa:
            self.called = True
            return _attention_under_vmap(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
