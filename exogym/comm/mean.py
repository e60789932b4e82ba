"""The counted mean over nodes: every averaging a strategy does goes through `mean_` / `start_mean` here.

Uncompressed, it is one all-reduce per dtype of the flattened tensors (as DDP's buckets), divided by the
number of members (or a given divisor). Compressed, it is one all-gather, decoded and summed in rank order:

Nodes cannot all-reduce int8 codes and keep their meaning (each node has its own scales, and a sum of
codes overflows), so each node encodes its tensors (exogym.comm.compression), packs every payload tensor into
one byte buffer and all-gathers it; every node then decodes every member's payloads and sums them in
rank order, so every node holds bit-identical results.

Bytes per node per call: (K - 1) P, where P = sum over the tensors of compressor.nbytes(shape) (ring
all-gather, exogym.comm.transport.all_gather_bytes). The float all-reduce it replaces sends 2 (K - 1) / K M, so
compressing pays when P < 2 M / K: int8 and fp8 for K < 8 nodes, int4 and fp4 for K < 16, top-k with
float32 values and int32 indices for fraction < 1 / K. (A ring all-reduce that re-quantizes partial sums
would send 2 (K - 1) / K P; it needs an all-to-all, which exogym.comm.collectives does not have.)

With compressor=None, the same call is the plain float all-reduce (one per dtype) and its mean. The bytes
are counted by exogym.comm.collectives, like any collective a strategy makes.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from exogym.comm.compression import Compressor, Payload
from exogym.comm.flatten import flat_base, flatten_by_dtype
from exogym.comm.collectives import Group, alive_ranks, all_gather, all_reduce, get_rank

__all__ = ["PendingMean", "start_mean", "compressed_mean", "mean_"]


class PendingMean:
    """A mean in flight: wait() returns it (one tensor per input tensor); sent() what this node's own
    payloads decode to (what the others received from it)."""

    def __init__(self, compressor: Compressor | None, count: int, own: list[Payload],
                 buffers: list, work: object, members: list[int], divisor: float, gathered_from: list[int]):
        # Uncompressed, buffers are [(flat, [(input index, shape)])]: no reference to the inputs, so a caller may
        # free them while the mean is in flight (the flat copies hold what is sent).
        self.compressor, self._count, self._own = compressor, count, own
        self._buffers, self._work, self.members, self.divisor = buffers, work, members, divisor
        self._result: list[torch.Tensor] | None = None
        self._slot = {rank: i for i, rank in enumerate(gathered_from)}  # rank -> its buffer in the all-gather

    @torch.no_grad()
    def wait(self, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The mean, one tensor per input (uncompressed: views of the received flat buffers); into=the tensors to
        write it into."""
        if self._result is not None:
            if into is not None:
                for t, r in zip(into, self._result):
                    t.copy_(r)
            return self._result
        if self._work is not None:
            self._work.wait()
        if self.compressor is None:
            self._result = self._float_mean(into)
        else:
            self._result = self._decoded_mean()
            for t, r in zip(into or (), self._result):
                t.copy_(r)
        self._buffers, self._work = [], None
        return self._result

    def sent(self) -> list[torch.Tensor]:
        if self.compressor is None:
            raise TypeError("sent() is what a compressor's payload decodes to; this mean was sent uncompressed")
        return [self.compressor.decode(p) for p in self._own]

    def _float_mean(self, into: list[torch.Tensor] | None) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [None] * self._count  # type: ignore[list-item]
        for flat, layout in self._buffers:
            flat.div_(self.divisor)
            chunks = flat.split([math.prod(shape) for _, shape in layout])
            for (i, shape), chunk in zip(layout, chunks):
                out[i] = chunk.view(shape)
        if into is None:
            return out
        for t, r in zip(into, out):
            if t.data_ptr() != r.data_ptr() or t.stride() != r.stride():  # a view of the sent buffer already holds it
                t.copy_(r)
        return list(into)

    def _decoded_mean(self) -> list[torch.Tensor]:
        total: list[torch.Tensor] | None = None
        for rank in self.members:  # rank order: the same sum, bit for bit, on every node
            decoded = [self.compressor.decode(p) for p in _unpack(self._buffers[self._slot[rank]], self._own)]
            total = decoded if total is None else [t.add_(d) for t, d in zip(total, decoded)]
        return [t.div_(self.divisor) for t in total]


@torch.no_grad()
def start_mean(tensors: Sequence[torch.Tensor], compressor: Compressor | None = None, *,
               group: Group | Sequence[int] | None = None, members: Sequence[int] | None = None,
               keys: Sequence[Hashable | None] | None = None, divisor: float | None = None,
               async_op: bool = False, consume: bool = False) -> PendingMean:
    """Start averaging `tensors` (the same shapes on every node) over `group` (default: all nodes; only the
    members up at this step take part): the sum over `members` (default: every member up) / divisor (default
    len(members)). A member outside `members` still takes part (sending its tensors, or zeros without
    compression) but its contribution is left out.
    keys: per tensor, the stream each belongs to (error feedback's memory); None for a node whose
    contribution is left out.
    async_op=True: the transfer runs while the node computes; the tensors may be changed at once.
    consume=True (uncompressed): the caller hands the list over; it is emptied once its tensors are copied into
    the flat buffers, before the transfer, so a node waiting in the mean holds no reference to them (in the sim
    the waiting node's flat buffer gives back its memory too)."""
    given = tensors
    base = None if async_op or compressor is not None or consume else flat_base(list(tensors))  # one flat already
    tensors = [t.detach() for t in tensors]
    up = alive_ranks(group)
    members = sorted(up if members is None else set(members) & set(up))
    divisor = float(len(members) if divisor is None else divisor)
    if compressor is None:
        # One flat buffer already (flat_views) is sent as it is; otherwise flat copies (also because an async
        # caller may change its tensors meanwhile).
        if base is not None:
            buffers = [(base.detach(), [(i, t.shape) for i, t in enumerate(tensors)])]
        else:
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, t in enumerate(tensors):
                by_dtype.setdefault(t.dtype, []).append(i)
            buffers = [(flat, [(i, tensors[i].shape) for i in indices])  # flatten_by_dtype's order: first-seen dtype
                       for (flat, _), indices in zip(flatten_by_dtype(tensors), by_dtype.values())]
        count = len(tensors)
        if consume:
            given.clear()  # type: ignore[attr-defined]
            del tensors
        works = []
        for flat, _ in buffers:
            if get_rank() not in members:
                flat.zero_()
            works.append(all_reduce(flat, group=group, async_op=async_op))
        return PendingMean(None, count, [], buffers, _AllOf(works) if async_op else None, members, divisor, up)
    keys = [None] * len(tensors) if keys is None else list(keys)
    own = [compressor.encode(t, key=k) for t, k in zip(tensors, keys)]
    packed = _pack(own)  # [P] uint8
    gathered = [torch.empty_like(packed) for _ in up]
    work = all_gather(gathered, packed, group=group, async_op=async_op)
    return PendingMean(compressor, len(tensors), own, gathered, work if async_op else None, members, divisor, up)


@torch.no_grad()
def mean_(tensors: Sequence[torch.Tensor], compressor: Compressor | None = None, **kwargs) -> None:
    """In place: each tensor becomes its mean over the nodes (arguments as start_mean). Alone in the group
    (the others down, or one node), nothing is sent and a plain mean of one is the tensor itself."""
    if len(alive_ranks(kwargs.get("group"))) == 1 and kwargs.get("divisor") is None:
        return
    start_mean(tensors, compressor, **kwargs).wait(into=list(tensors))


def compressed_mean(tensors: Sequence[torch.Tensor], compressor: Compressor | None, **kwargs) -> list[torch.Tensor]:
    """start_mean(...).wait(): the mean at once."""
    return start_mean(tensors, compressor, **kwargs).wait()


class _AllOf:
    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def _pack(payloads: list[Payload]) -> torch.Tensor:
    """Every payload tensor's bytes, one after another, in one uint8 buffer (what the all-gather sends)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for p in payloads for t in p.tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat(parts)


def _unpack(buffer: torch.Tensor, layout: list[Payload]) -> list[Payload]:
    """Another node's buffer cut into payloads laid out like this node's own (every node's are alike)."""
    out, offset = [], 0
    for p in layout:
        tensors = []
        for t in p.tensors:
            n = t.numel() * t.element_size()
            # clone: a slice at an odd offset cannot be viewed as a wider dtype
            tensors.append(buffer[offset:offset + n].clone().view(t.dtype).view(t.shape))
            offset += n
        out.append(p.with_tensors(tensors))
    return out
