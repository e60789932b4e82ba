"""Collectives for strategies: `all_reduce(t)`, `broadcast(t, src)`, ... as in torch.distributed.

Each call goes to the calling node's backend (the in-process sim, or torch.distributed) and
adds the bytes that node sends to its count (formulas in `exogym.comm.transport`). `group` is None for
all nodes, a `Group` from `new_group`, or a list of ranks. With async_op=True a call returns a
handle at once and the node keeps computing; `handle.wait()` makes the results visible (as in
torch.distributed, the tensors must not be read or written before then).

When the run has a failure or elastic schedule (exogym.cluster.membership), a group means its members that are up
at the current step: collectives run without the nodes that are down, and `alive_ranks(group)` says who
takes part (one tensor per such member in all_gather and reduce_scatter lists; divide means by its length).
"""

from __future__ import annotations

from typing import Sequence

import torch

from exogym.comm import transport as _comm
from exogym.comm.transport import Group, ReduceOp, Work

from exogym.comm.messages import (SERVER, Message, Server, irecv, isend, now, read_server, recv,  # noqa: E402
                                  send, serve, poll)

__all__ = [
    "ReduceOp", "Group", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier",
    "new_group", "get_rank", "get_world_size", "alive_ranks", "in_running_node",
    # point-to-point messages and the server (exogym.comm.messages), here too so that
    # exogym.strategy.communicate offers them beside the collectives, as torch.distributed does
    "SERVER", "Message", "Server", "send", "isend", "recv", "irecv", "poll", "serve", "read_server", "now",
]


def _group(c: _comm.Transport, group: Group | Sequence[int] | None) -> Group:
    """The members of `group` that take part now: all of them, or those up at this step."""
    g = c.world if group is None else group if isinstance(group, Group) else _comm.make_group(group, c.num_nodes)
    if c.rank not in g:
        raise ValueError(f"node {c.rank} called a collective on group {list(g.ranks)}, which it is not in")
    up = c.up()
    if up is c.world.ranks:  # no failure or elastic schedule: everyone is up
        return g
    if c.rank not in up:
        raise _comm.CollectiveError(f"node {c.rank} is down at step {c.step} but called a collective")
    return g if all(r in up for r in g.ranks) else Group(tuple(r for r in g.ranks if r in up))


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_per_member(op: str, name: str, tensors: list[torch.Tensor], like: torch.Tensor, g: Group) -> None:
    """One tensor per group member, each shaped like `like`."""
    if len(tensors) != g.size:
        raise ValueError(f"{op} needs one tensor in {name} per group member ({g.size}), got {len(tensors)}")
    for i, t in enumerate(tensors):
        if _check_tensor(f"{name}[{i}]", t).shape != like.shape:
            raise ValueError(f"{op} {name}[{i}] has shape {tuple(t.shape)}, but it must match "
                             f"{tuple(like.shape)}")


def all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM, group: Group | Sequence[int] | None = None,
               async_op: bool = False) -> torch.Tensor | Work:
    """Reduce `tensor` across the group in place (summed in rank order, so results are deterministic).

    Args:
        tensor: This node's tensor; it receives the result.
        op: A ReduceOp, its string value (`"sum"`, `"avg"`, `"max"`, `"min"`, `"product"`), or
            `torch.distributed.ReduceOp`.
        group: The members: a Group, a list of global ranks, or None for every node.
        async_op: Return a Work at once and complete the call when it is waited on (its transfer
                overlaps the compute in between).

    Returns:
        `tensor`, or a Work with `async_op=True`.

    Raises:
        CollectiveError: The group's members issued different calls, shapes or dtypes.
        ValueError: An unsupported op.
    """
    c = _comm.current_transport()
    g, op = _group(c, group), ReduceOp.of(op)
    _check_tensor("tensor", tensor)
    n = _comm.tensor_nbytes(tensor)
    c.stats.add("all_reduce", _comm.all_reduce_bytes(n, g.size), _comm.payload_bytes("all_reduce", n, g))
    work = c.all_reduce(tensor, op, g, account=True, async_op=async_op)
    return work if async_op else tensor



def sum_as_bookkeeping(tensor: torch.Tensor, group: Group | Sequence[int] | None = None) -> torch.Tensor:
    """Sum `tensor` over the group's members up now, in place, as the run's bookkeeping, not its traffic: no bytes
    counted and no simulated time. For what the library's strategies must know to end a run (how many messages are
    still in flight to a node), never for what an algorithm communicates; not exported.

    Args:
        tensor: This node's tensor; it receives the sum.
        group: The members: a Group, a list of global ranks, or None for every node.

    Returns:
        `tensor`.
    """
    c = _comm.current_transport()
    c.all_reduce(_check_tensor("tensor", tensor), ReduceOp.SUM, _group(c, group), account=False)
    return tensor

def broadcast(tensor: torch.Tensor, src: int = 0, group: Group | Sequence[int] | None = None,
              async_op: bool = False) -> torch.Tensor | Work:
    """Copy node `src`'s tensor into every member's `tensor` in place.

    Args:
        tensor: This node's tensor: sent from `src`, overwritten elsewhere.
        src: The sender, a global rank.
        group: The members: a Group, a list of global ranks, or None for every node.
        async_op: Return a Work at once and complete the call when it is waited on (its transfer
                overlaps the compute in between).

    Returns:
        `tensor`, or a Work with `async_op=True`.

    Raises:
        ValueError: `src` is not in the group (or is down at this step).
        CollectiveError: The group's members issued different calls, shapes or dtypes.
    """
    c = _comm.current_transport()
    g = _group(c, group)
    _check_tensor("tensor", tensor)
    if src not in g:
        down = " (it is down at this step)" if src in _group_ranks(c, group) else ""
        raise ValueError(f"broadcast src={src!r} is not in the group {list(g.ranks)}{down}")
    n = _comm.tensor_nbytes(tensor)
    c.stats.add("broadcast", _comm.broadcast_bytes(n, g, src, c.rank),
                _comm.payload_bytes("broadcast", n, g, src=src, rank=c.rank))
    work = c.broadcast(tensor, src, g, account=True, async_op=async_op)
    return work if async_op else tensor


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: Group | Sequence[int] | None = None, async_op: bool = False) -> list[torch.Tensor] | Work:
    """Fill `tensor_list[i]` with the tensor of the group's i-th member (members sorted by rank).

    Args:
        tensor_list: One tensor per member, shaped like `tensor`; filled in place.
        tensor: This node's tensor.
        group: The members: a Group, a list of global ranks, or None for every node.
        async_op: Return a Work at once and complete the call when it is waited on (its transfer
                overlaps the compute in between).

    Returns:
        `tensor_list`, or a Work with `async_op=True`.

    Raises:
        CollectiveError: The group's members issued different calls, shapes or dtypes.
        ValueError: `tensor_list` does not hold one tensor like `tensor` per member.
    """
    c = _comm.current_transport()
    g = _group(c, group)
    _check_per_member("all_gather", "tensor_list", tensor_list, _check_tensor("tensor", tensor), g)
    n = _comm.tensor_nbytes(tensor)
    c.stats.add("all_gather", _comm.all_gather_bytes(n, g.size), _comm.payload_bytes("all_gather", n, g))
    work = c.all_gather(tensor_list, tensor, g, account=True, async_op=async_op)
    return work if async_op else tensor_list


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: object = ReduceOp.SUM,
                   group: Group | Sequence[int] | None = None, async_op: bool = False) -> torch.Tensor | Work:
    """`output` on the group's i-th member becomes the reduction over members of their `input_list[i]`.

    Args:
        output: This node's result tensor.
        input_list: One tensor per member, shaped like `output`.
        op: A ReduceOp, its string value, or `torch.distributed.ReduceOp`.
        group: The members: a Group, a list of global ranks, or None for every node.
        async_op: Return a Work at once and complete the call when it is waited on (its transfer
                overlaps the compute in between).

    Returns:
        `output`, or a Work with `async_op=True`.

    Raises:
        CollectiveError: The group's members issued different calls, shapes or dtypes.
        ValueError: `input_list` does not hold one tensor like `output` per member, or an unsupported op.
    """
    c = _comm.current_transport()
    g, op = _group(c, group), ReduceOp.of(op)
    _check_per_member("reduce_scatter", "input_list", input_list, _check_tensor("output", output), g)
    n = sum(map(_comm.tensor_nbytes, input_list))
    c.stats.add("reduce_scatter", _comm.reduce_scatter_bytes(n, g.size), _comm.payload_bytes("reduce_scatter", n, g))
    work = c.reduce_scatter(output, input_list, op, g, account=True, async_op=async_op)
    return work if async_op else output


def barrier(group: Group | Sequence[int] | None = None, async_op: bool = False) -> Work | None:
    """Wait until every member of the group has reached this call.

    Args:
        group: The members: a Group, a list of global ranks, or None for every node.
        async_op: Return a Work at once and complete the call when it is waited on (its transfer
                overlaps the compute in between).

    Returns:
        None, or a Work with `async_op=True`.
    """
    c = _comm.current_transport()
    g = _group(c, group)
    c.stats.add("barrier", 0)
    return c.barrier(g, account=True, async_op=async_op)


def new_group(ranks: Sequence[int]) -> Group:
    """A group of the given ranks.

    As in torch.distributed, every node should create the same groups in the same order.

    Args:
        ranks: The members' global ranks.

    Returns:
        The Group.
    """
    return _comm.current_transport().new_group(ranks)


def get_rank() -> int:
    """The calling node's rank (0..`get_world_size()`-1).

    Returns:
        The rank.
    """
    return _comm.current_transport().rank


def get_world_size() -> int:
    """Every node of the run, up or down (ranks are 0..`get_world_size()`-1); see `alive_ranks()`.

    Returns:
        The number of nodes.
    """
    return _comm.current_transport().num_nodes


def alive_ranks(group: Group | Sequence[int] | None = None, *, step: int | None = None) -> list[int]:
    """The members of `group` that take part in a collective at this step (or at `step`).

    Every member, unless the run's failure or elastic schedule has some of them down.

    Args:
        group: The members: a Group, a list of global ranks, or None for all nodes.
        step: A step, counted from 1; default: the calling node's current step.

    Returns:
        The ranks up, sorted.
    """
    c = _comm.current_transport()
    if step is None:
        return list(_group(c, group).ranks)
    up = c.up(step)
    return [r for r in _group_ranks(c, group) if r in up]


def ranks_up_from(step: int) -> frozenset[int]:
    """The nodes up at `step` or at any later step of the run (every node, without a failure or elastic schedule):
    the others are gone for good. Not exported: for the library's strategies' warnings.

    Args:
        step: A step, counted from 1.

    Returns:
        The ranks.
    """
    c = _comm.current_transport()
    return frozenset(c.world.ranks) if c.membership is None else c.membership.up_from(step)


def in_running_node() -> bool:
    """Whether the caller runs inside a node of a running fit (where collectives work)."""
    return _comm.bound_transport() is not None


def _group_ranks(c: _comm.Transport, group: Group | Sequence[int] | None) -> tuple[int, ...]:
    return c.world.ranks if group is None else group.ranks if isinstance(group, Group) else tuple(group)
