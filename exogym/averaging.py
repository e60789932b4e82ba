"""The global model: the strategy's own entries, the rest averaged across nodes.

Used for "global" validation and for the model `fit` returns. This traffic is a measurement,
not part of the algorithm, so it goes straight to the backend and is not counted as bytes sent.
"""

from __future__ import annotations

import torch

from exogym.comm import Communicator, ReduceOp, nodes_up
from exogym.flatten import flatten_by_dtype, unflatten_into

__all__ = ["global_state_dict", "mean_over"]


@torch.no_grad()
def global_state_dict(model: torch.nn.Module, strategy, comm: Communicator) -> dict[str, torch.Tensor]:
    """Every node must call this together, up or down. Float entries are averaged over the nodes up at this
    step (one all-reduce per dtype), the strategy's own entries come from the first node up, non-float
    buffers (BatchNorm's num_batches_tracked) are this node's own; meaningful on node 0."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    overrides = dict(strategy.global_state() or {})
    unknown = set(overrides) - set(state)
    if unknown:
        raise KeyError(f"{type(strategy).__name__}.global_state() returned keys not in the model: {sorted(unknown)}")
    averaged = [k for k, v in state.items() if k not in overrides and v.is_floating_point()]
    up = nodes_up(comm)
    for flat, tensors in flatten_by_dtype(state[k] for k in averaged):
        mean_over(flat, up, comm)
        unflatten_into(flat, tensors)
    for k, v in overrides.items():
        state[k] = v.detach().to(state[k].device, state[k].dtype).clone()
    if overrides and up[0] != 0:  # node 0 is down: its copy of the strategy's global model is stale
        for flat, tensors in flatten_by_dtype(state[k] for k in overrides):
            comm.broadcast(flat, up[0], comm.world)
            unflatten_into(flat, tensors)
    return state


@torch.no_grad()
def mean_over(flat: torch.Tensor, members: tuple[int, ...] | list[int], comm: Communicator) -> None:
    """In place, the mean of `flat` over the nodes `members`; every node calls it (those outside add zeros).
    Uncounted: for measurements, which every node joins whether or not its own copy counts."""
    if len(members) == comm.num_nodes:
        comm.all_reduce(flat, ReduceOp.AVG, comm.world)
        return
    if comm.rank not in members:
        flat.zero_()
    comm.all_reduce(flat, ReduceOp.SUM, comm.world)
    flat.div_(len(members))
