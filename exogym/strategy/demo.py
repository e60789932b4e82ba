"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from exogym._validation import check_int, check_number
from exogym.comm.flatten import flatten_by_dtype
from exogym.comm.collectives import alive_ranks, all_gather
from exogym.strategy.optim import OptimSpec
from exogym.strategy.base import Strategy, parameter_state

__all__ = ["DeMo", "DeMoStrategy", "ChunkDCT", "dct_matrix"]


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix D [n, n]: X = D x, and x = D^T X (D is orthogonal)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(device=device, dtype=dtype)


def _chunk(n: int, limit: int) -> int:
    """The largest divisor of n that is <= limit (so chunks tile the dimension exactly)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class ChunkDCT:
    """A tensor <-> its per-chunk DCT coefficients [chunks, coefficients per chunk].

    1-D tensors (and scalars) are cut into chunks of c entries, c the largest divisor of the length
    <= chunk; tensors of 2 or more dims are viewed as [shape[0], rest] and cut into 2-D chunks
    (r x c, each the largest divisor of its dimension <= chunk), transformed along both axes.
    """

    def __init__(self, shape: torch.Size, chunk: int):
        self.shape = shape
        rows, cols = (1, max(1, math.prod(shape))) if len(shape) < 2 else (shape[0], math.prod(shape[1:]))
        self.rows, self.cols = rows, cols
        self.r = 1 if len(shape) < 2 else _chunk(rows, chunk)
        self.c = _chunk(cols, chunk)
        self.num_chunks = (rows // self.r) * (cols // self.c)
        self.chunk_numel = self.r * self.c

    def encode(self, x: torch.Tensor, dr: torch.Tensor, dc: torch.Tensor) -> torch.Tensor:
        blocks = x.reshape(self.rows // self.r, self.r, self.cols // self.c, self.c).transpose(1, 2)  # [br, bc, r, c]
        coeffs = dr @ blocks @ dc.T  # X = D_r B D_c^T per block
        return coeffs.reshape(self.num_chunks, self.chunk_numel)

    def decode(self, coeffs: torch.Tensor, dr: torch.Tensor, dc: torch.Tensor) -> torch.Tensor:
        blocks = coeffs.reshape(self.rows // self.r, self.cols // self.c, self.r, self.c)
        x = dr.T @ blocks @ dc  # B = D_r^T X D_c
        return x.transpose(1, 2).reshape(self.shape)


class DeMo(torch.optim.Optimizer):
    """The DeMo optimizer; its `step()` communicates (call it on every node together).

    Per parameter (Algorithm 1 of the paper, as bloc97/DeMo implements it): m <- beta m + lr g (lr of this
    step); q = the top-k DCT components of m in each chunk; m <- m - q; the (index, value) pairs of q are
    all-gathered; each coefficient is averaged over the nodes that sent it;
    theta <- theta (1 - lr wd) - lr sign(IDCT(average)). The lr enters twice, as in the reference: it scales
    what goes into the momentum and the sign step. Under a schedule this changes which components are sent
    (old gradients weigh by the lr they came with), so it matters only when the lr varies.

    Args:
        params: The parameters (or parameter groups) to optimize.
        lr: The learning rate.
        compression_decay: beta, the momentum's decay.
        compression_topk: k, the DCT components sent per chunk.
        compression_chunk: The chunk size (each chunk is a block of this side) of the DCT.
        weight_decay: Decoupled weight decay wd.
        lr_scaled_momentum: False accumulates the raw gradient instead (m <- beta m + g; the paper's
            Algorithm 1 as written); at a constant lr the two send the same components and take the same steps.

    Raises:
        ValueError: A value out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64, weight_decay: float = 0.0,
                 lr_scaled_momentum: bool = True):
        check_number("lr", lr, positive=True, finite=True)
        check_number("compression_decay", compression_decay, minimum=0.0)
        if compression_decay >= 1:
            raise ValueError(f"compression_decay must be in [0, 1) (the momentum's decay), got {compression_decay!r}")
        check_int("compression_topk", compression_topk, minimum=1)
        check_int("compression_chunk", compression_chunk, minimum=1)
        check_number("weight_decay", weight_decay, minimum=0.0, finite=True)
        if not isinstance(lr_scaled_momentum, bool):
            raise TypeError(f"lr_scaled_momentum must be True (momentum accumulates lr x gradient, as the reference "
                            f"implementation) or False (the raw gradient), got {lr_scaled_momentum!r}")
        super().__init__(params, dict(lr=lr, compression_decay=compression_decay, compression_topk=compression_topk,
                                      compression_chunk=compression_chunk, weight_decay=weight_decay,
                                      lr_scaled_momentum=lr_scaled_momentum))

    def _d(self, n: int, like: torch.Tensor) -> torch.Tensor:
        # A cache outside Optimizer.__getstate__ (which pickles only state and param groups): rebuilt after a resume.
        cache = self.__dict__.setdefault("_dct", {})
        key = (n, like.dtype, like.device)
        if key not in cache:
            cache[key] = dct_matrix(n, like.dtype, like.device)
        return cache[key]

    def plan(self, p: torch.Tensor, group: dict) -> ChunkDCT:
        """How parameter `p` is cut into chunks for the DCT.

        Args:
            p: The parameter.
            group: Its parameter group (`compression_chunk`).

        Returns:
            The parameter's ChunkDCT.
        """
        return ChunkDCT(p.shape, group["compression_chunk"])

    @torch.no_grad()
    def extract(self, p: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulate the gradient into the momentum and take out its top-k DCT components per chunk.

        Args:
            p: The parameter.
            group: Its parameter group (lr, `compression_decay`, `compression_topk`, ...).

        Returns:
            `(indices [chunks, k] int64, values [chunks, k])`.
        """
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(p)
        m = state["momentum"]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        scale = group["lr"] if group.get("lr_scaled_momentum", True) else 1.0  # the reference's delta += lr g
        m.mul_(group["compression_decay"]).add_(grad, alpha=scale)
        t = self.plan(p, group)
        dr, dc = self._d(t.r, m), self._d(t.c, m)
        coeffs = t.encode(m, dr, dc)  # [chunks, r*c]
        k = min(group["compression_topk"], t.chunk_numel)
        idx = coeffs.abs().topk(k, dim=1, sorted=False).indices  # [chunks, k]
        values = coeffs.gather(1, idx)
        m.sub_(t.decode(torch.zeros_like(coeffs).scatter_(1, idx, values), dr, dc))  # the fast components leave m
        return idx, values

    @torch.no_grad()
    def combine(self, p: torch.Tensor, group: dict, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Decode every node's components into the dense average, shaped like `p`.

        A coefficient sent by several nodes is their mean; one sent by a single node keeps its value.

        Args:
            p: The parameter.
            group: Its parameter group.
            idx: Every node's indices, `[chunks, K*k]`.
            values: Every node's values, `[chunks, K*k]`.

        Returns:
            The decoded average, shaped like `p`.
        """
        t = self.plan(p, group)
        sums = torch.zeros(t.num_chunks, t.chunk_numel, dtype=values.dtype, device=values.device)
        counts = torch.zeros_like(sums)
        sums.scatter_add_(1, idx, values)
        counts.scatter_add_(1, idx, torch.ones_like(values))
        return t.decode(sums / counts.clamp_min(1), self._d(t.r, sums), self._d(t.c, sums))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """One DeMo step on every parameter: extract, all-gather, combine, the sign update (on every node together).

        Args:
            closure: Not supported (must be None).

        Raises:
            TypeError: A closure is given.
        """
        if closure is not None:
            raise TypeError("DeMo.step does not take a closure")
        entries = [(p, g) for g in self.param_groups for p in g["params"] if p.requires_grad]  # frozen: not sent
        sent = [self.extract(p, g) for p, g in entries]
        for p, _ in entries:
            p.grad = None  # in the momentum now: a node waiting in the all-gather holds no gradients (zero_grad's None)
        gathered = self._all_gather([i for i, _ in sent], [v for _, v in sent])
        for (p, g), (idx, values) in zip(entries, gathered):
            update = self.combine(p, g, idx, values)
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(update.sign(), alpha=-g["lr"])

    def _all_gather(self, indices: list[torch.Tensor], values: list[torch.Tensor]):
        """One all-gather of every parameter's indices (int64) and one per value dtype; returns per
        parameter (indices, values), each [chunks, K*k] with node j's in columns j*k..(j+1)*k."""
        k_nodes = len(alive_ranks())  # the nodes up at this step
        out_idx = _gather_flat(indices, k_nodes)
        out_val = _gather_flat(values, k_nodes)
        return list(zip(out_idx, out_val))


def _gather_flat(tensors: list[torch.Tensor], k_nodes: int) -> list[torch.Tensor]:
    """All-gather a list of [chunks_i, k_i] tensors (flattened per dtype into one buffer each)."""
    result: dict[int, torch.Tensor] = {}
    position = {id(t): i for i, t in enumerate(tensors)}
    for flat, members in flatten_by_dtype(tensors):
        parts = [torch.empty_like(flat) for _ in range(k_nodes)]
        all_gather(parts, flat)
        offset = 0
        for t in members:
            n = t.numel()
            pieces = [part[offset:offset + n].view_as(t) for part in parts]
            result[position[id(t)]] = torch.cat(pieces, dim=1)  # [chunks, K*k]
            offset += n
    return [result[i] for i in range(len(tensors))]


class DeMoStrategy(Strategy):
    """DeMo: each node sends only the fast components of its momentum; all apply the same sign update.

    Every step each node adds its gradient to its own momentum, sends only the fast components of it (top-k DCT
    coefficients per chunk, removed from the momentum, the rest stays local), and all nodes apply the same sign
    update from the decoded average of what was sent.

    Paper: Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization" (2024), arXiv 2411.19870.
    Bytes per node per step: (K-1) x sum over parameters of chunks x topk x (8 index + value bytes)
    (ring all-gather). A node that drops keeps its momentum residual; the others go on without its share.

    Args:
        optim_spec: `OptimSpec(DeMo, lr=..., ...)` or nothing. A spec of a torch optimizer
            (`OptimSpec(torch.optim.AdamW, lr=..., weight_decay=...)`, as the original's scripts pass) gives DeMo
            its lr and weight_decay (`exogym.compat.spellings.demo_from_torch_spec`).
        max_norm: Clip the global gradient norm to this before each step.
        lr: DeMo's learning rate (the keywords override the spec's).
        compression_decay: The momentum's decay (see DeMo).
        compression_topk: DCT coefficients sent per chunk (see DeMo).
        compression_chunk: The chunk size of the DCT (see DeMo).
        weight_decay: DeMo's weight decay.
        lr_scaled_momentum: True (default): the momentum accumulates lr x gradient, as bloc97/DeMo does; False:
            the raw gradient.
        **kwargs: The Strategy's options (`lr_scheduler`, `lr_scheduler_kwargs`, `warmup_steps`,
            `cosine_anneal`, `min_lr_factor`). Any other keyword is a TypeError listing the accepted ones.

    Raises:
        TypeError: An unknown keyword, or a spec of an optimizer DeMo cannot take its options from.
        ValueError: A value out of range.
    """


    def __init__(self, optim_spec: OptimSpec | None = None, max_norm: float | None = None, *,
                 lr: float | None = None, compression_decay: float | None = None, compression_topk: int | None = None,
                 compression_chunk: int | None = None, weight_decay: float | None = None,
                 lr_scaled_momentum: bool | None = None, **kwargs: Any):
        super().__init__(max_norm=max_norm, **kwargs)
        settings = {k: v for k, v in dict(lr=lr, compression_decay=compression_decay,
                                          compression_topk=compression_topk, compression_chunk=compression_chunk,
                                          weight_decay=weight_decay, lr_scaled_momentum=lr_scaled_momentum).items()
                    if v is not None}
        if optim_spec is None:
            optim_spec = OptimSpec(DeMo, **settings)
        elif not (isinstance(optim_spec, OptimSpec) and issubclass(optim_spec.cls, DeMo)):
            raise TypeError(f"DeMoStrategy's optim_spec must be an OptimSpec of exogym.strategy.demo.DeMo, got "
                            f"{optim_spec!r}; or leave it out and pass lr=..., compression_topk=...")
        elif settings:  # keywords next to a spec override its values, as for every strategy
            optim_spec = OptimSpec(DeMo, **{**optim_spec.kwargs, **settings})
        defaults = dict(lr=1e-3, compression_decay=0.999, compression_topk=32, compression_chunk=64, weight_decay=0.0)
        DeMo([torch.zeros(1, requires_grad=True)], **{**defaults, **optim_spec.kwargs})  # validate now, not per node
        self.optim_spec = optim_spec

    def step(self) -> None:
        self._clip_grads()
        self.optim.step()
        super().step()

    def global_state(self) -> Mapping[str, torch.Tensor]:
        return parameter_state(self.model)  # every node applies the same sign update

    @torch.no_grad()
    def joined(self) -> None:
        for s in self.optim.state.values():  # a node coming up starts with no momentum: the survivor's residual
            if "momentum" in s:             # is that node's own unsent gradient, which it still sends itself
                s["momentum"].zero_()
