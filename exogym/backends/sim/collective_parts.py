"""What each collective sends and computes when its members live in several processes (exogym.backends.sim.exchange).

A process holding some of a collective's members sends its part (from its local members, in rank order) to the
group's leader process; the leader combines the parts in process order, which is rank order (each process holds a
contiguous block of nodes), and sends each other holder its reply; every holder writes its reply into its local
members' tensors.

Sums come in two kinds. A strategy's (counted) sum is summed per process, then across processes: each process
holds one accumulator however many of its members wait, and only that reassociation differs from one process's
rank-order sum. An uncounted sum (a measurement: the global model that validation evaluates and `fit` returns) is
exact: a holder other than the leader sends its members' tensors one by one (`ordered`), and the leader adds them
to its own members' sum in rank order, which is one process's sum bit for bit; what is measured then does not
depend on how the nodes are laid over processes, at the price of a waiting member's buffer in those holders.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from exogym.backends.sim.baton import CollectiveCall
from exogym.backends.sim.transport import reduce_into
from exogym.comm.transport import ReduceOp

__all__ = ["OPS", "CollectiveParts"]


def _reduce(tensors: Sequence[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """op over the tensors, left to right, into a new tensor (AVG: the sum; the leader divides once)."""
    acc = tensors[0].clone()
    reduce_into(acc, tensors[1:], op)
    return acc


class CollectiveParts:
    """One collective kind across processes. `part(calls)`: this process's part (None: it sends nothing);
    `part_like(calls, ranks)`: an empty part of the holder with members `ranks`, for the leader to receive into
    (None: that holder sends nothing); `combine(calls, parts, counts, group)`: the leader's replies, one per holder
    in process order; `reply_like(calls, group)`: an empty reply for this holder to receive into (None: it gets
    none); `deliver(calls, reply, first)`: the reply into the local members' tensors (`first`: the index of this
    process's first member in the group)."""

    def __init__(self, part: Callable, part_like: Callable, combine: Callable, reply_like: Callable,
                 deliver: Callable):
        self.part, self.part_like, self.combine = part, part_like, combine
        self.reply_like, self.deliver = reply_like, deliver


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=False)


# ---- all_reduce: a partial reduction per process, reduced again by the leader (ordered: the members' tensors) -----
def _reduce_part(calls: list[CollectiveCall]) -> torch.Tensor:
    box = calls[0].args.get("fold")
    if box is not None:  # folded (or, ordered, stacked) as the members arrived (exogym.backends.sim.transport)
        return _cpu(box["acc"])
    return _cpu(_reduce([c.args["tensor"].to(calls[0].args["tensor"].device) for c in calls], calls[0].args["op"]))


def _reduce_part_like(calls: list[CollectiveCall], ranks: Sequence[int]) -> torch.Tensor:
    # On the CPU; its data is never read (the local tensor may have been given back meanwhile).
    t = calls[0].args["tensor"]
    if calls[0].args.get("ordered"):  # that holder's members' tensors, one row each
        return torch.empty((len(ranks), *t.shape), dtype=t.dtype)
    return torch.empty_like(t, device="cpu")


def _reduce_reply_like(calls: list[CollectiveCall], group: Sequence[int]) -> torch.Tensor:
    return torch.empty_like(calls[0].args["tensor"], device="cpu")


def _reduce_combine(calls: list[CollectiveCall], parts: list[torch.Tensor], counts: list[int],
                    group: tuple[int, ...]) -> list[torch.Tensor]:
    op = calls[0].args["op"]
    if calls[0].args.get("ordered"):  # the leader's own members' sum, then every other member's tensor in rank order
        total = parts[0].clone()
        for rows in parts[1:]:
            reduce_into(total, rows.unbind(0), op)
    else:
        total = _reduce(parts, op)
    if op is ReduceOp.AVG:
        total.div_(len(group))
    return [total] * len(parts)


def _copy_into_tensor(calls: list[CollectiveCall], reply: torch.Tensor, first: int) -> None:
    for c in calls:
        if c.args.get("released"):  # its memory was given back while it waited: it copies the reply on resuming
            c.args["result"] = reply
        else:
            c.args["tensor"].copy_(reply)
    calls[0].args.pop("fold", None)  # the accumulator has been sent (or combined): let it go


# ---- broadcast: the source's holder sends the source tensor ------------------------------------------------------
def _source(calls: list[CollectiveCall]) -> torch.Tensor | None:
    src = calls[0].args["src"]
    return next((_cpu(c.args["tensor"]) for c in calls if c.args["rank"] == src), None)


def _source_like(calls: list[CollectiveCall], ranks: Sequence[int]) -> torch.Tensor | None:
    t = calls[0].args["tensor"]
    return torch.empty(t.shape, dtype=t.dtype) if calls[0].args["src"] in ranks else None


def _source_reply_like(calls: list[CollectiveCall], group: Sequence[int]) -> torch.Tensor:
    t = calls[0].args["tensor"]
    return torch.empty(t.shape, dtype=t.dtype)


def _broadcast_combine(calls, parts, counts, group):
    source = next(p for p in parts if p is not None)
    return [source] * len(parts)


# ---- all_gather: every holder sends its members' tensors, every holder gets all of them -------------------------
def _gather_part(calls: list[CollectiveCall]) -> torch.Tensor:
    return _cpu(torch.stack([c.args["tensor"].to(calls[0].args["tensor"].device) for c in calls]))


def _gather_like(calls: list[CollectiveCall], ranks: Sequence[int]) -> torch.Tensor:
    t = calls[0].args["tensor"]
    return torch.empty((len(ranks), *t.shape), dtype=t.dtype)


def _gather_combine(calls, parts, counts, group):
    everyone = torch.cat(parts)  # [group size, ...] in rank order
    return [everyone] * len(parts)


def _gather_deliver(calls: list[CollectiveCall], reply: torch.Tensor, first: int) -> None:
    gathered = list(reply.unbind(0))
    for c in calls:
        if c.args.get("outputs_released"):
            c.args["gathered"] = gathered  # filled when that node resumes (exogym.backends.sim.transport._restore)
            continue
        for out, member in zip(c.args["tensor_list"], gathered):
            out.copy_(member)


# ---- reduce_scatter: every holder sends its members' input lists, gets its members' outputs ----------------------
def _scatter_part(calls: list[CollectiveCall]) -> torch.Tensor:
    device = calls[0].args["output"].device
    return _cpu(torch.stack([torch.stack([t.to(device) for t in c.args["input_list"]]) for c in calls]))


def _scatter_like(calls: list[CollectiveCall], ranks: Sequence[int]) -> torch.Tensor:
    t = calls[0].args["output"]
    return torch.empty((len(ranks), len(calls[0].args["input_list"]), *t.shape), dtype=t.dtype)


def _scatter_reply_like(calls: list[CollectiveCall], group: Sequence[int]) -> torch.Tensor:
    t = calls[0].args["output"]  # this holder's members' outputs
    return torch.empty((len(calls), *t.shape), dtype=t.dtype)


def _scatter_combine(calls, parts, counts, group):
    op = calls[0].args["op"]
    inputs = torch.cat(parts)  # [member, chunk, ...]
    outputs = []
    for j in range(len(group)):  # member j's output: chunk j reduced over the members in rank order
        out = _reduce(list(inputs[:, j].unbind(0)), op)
        if op is ReduceOp.AVG:
            out.div_(len(group))
        outputs.append(out)
    replies, start = [], 0
    for n in counts:
        replies.append(torch.stack(outputs[start:start + n]))
        start += n
    return replies


def _scatter_deliver(calls: list[CollectiveCall], reply: torch.Tensor, first: int) -> None:
    for c, out in zip(calls, reply.unbind(0)):
        c.args["output"].copy_(out)


OPS: dict[str, CollectiveParts] = {
    "all_reduce": CollectiveParts(_reduce_part, _reduce_part_like, _reduce_combine, _reduce_reply_like,
                                  _copy_into_tensor),
    "broadcast": CollectiveParts(_source, _source_like, _broadcast_combine, _source_reply_like, _copy_into_tensor),
    "all_gather": CollectiveParts(_gather_part, _gather_like, _gather_combine, _gather_like, _gather_deliver),
    "reduce_scatter": CollectiveParts(_scatter_part, _scatter_like, _scatter_combine, _scatter_reply_like,
                                      _scatter_deliver),
    "barrier": CollectiveParts(lambda calls: None, lambda calls, ranks: None,
                               lambda calls, parts, counts, group: [None] * len(parts),
                               lambda calls, group: None, lambda calls, reply, first: None),
}
