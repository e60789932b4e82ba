"""The global model: the strategy's own entries (identical on every node), the rest averaged over its sources.

One rule serves validation ("global" rows), the model `fit` returns, and nodes coming up after a failure:
- entries of `strategy.global_state()` are the same on every node by construction (DDP's replicated
  parameters, DiLoCo's outer parameters), so one node's copy is taken, never an average of copies;
- every other floating-point entry is the mean over `strategy.model_sources(...)` (by default, the nodes
  up; FedAvg under client sampling, the current round's clients);
- integer buffers (BatchNorm's num_batches_tracked) are the node's own.
Validation's traffic is a measurement, not part of the algorithm: it goes straight to the backend and is not
counted. A joiner's model is real traffic: exogym.engine.rejoin builds it with the counted mean.
"""

from __future__ import annotations

import torch

from exogym.comm.transport import Transport, ReduceOp
from exogym.comm.flatten import flatten_by_dtype, unflatten_into

__all__ = ["global_state_dict", "split_global_state", "mean_over"]


@torch.no_grad()
def split_global_state(model: torch.nn.Module, strategy) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(a copy of the model's state with the strategy's global entries in place, the keys to average, the
    strategy's global keys)."""
    entries = model.state_dict()
    overrides = _global_entries(entries, strategy)
    state = {k: (overrides[k] if k in overrides else v).detach().to(v.device, v.dtype).clone()
             for k, v in entries.items()}
    return state, _averaged_keys(state, overrides), list(overrides)


@torch.no_grad()
def global_state_dict(model: torch.nn.Module, strategy, comm: Transport, *,
                      result: bool = True) -> dict[str, torch.Tensor] | None:
    """Every node must call this together, up or down; the result is meaningful on the nodes up. The
    strategy's entries come from the first node up, the rest are averaged over its model sources among
    the nodes up (one all-reduce per dtype). result=False: this node only takes part (it sends its share, and the
    strategy's entries when it is the first node up, and keeps no copy of the model, so K nodes waiting in the mean
    hold K buffers of the averaged entries only)."""
    up = list(comm.up())
    if result:
        state, averaged, own = split_global_state(model, strategy)
    else:
        state = model.state_dict()
        overrides = _global_entries(state, strategy)
        own = list(overrides)
        averaged = _averaged_keys(state, overrides)
        if own and comm.rank == up[0] != 0:  # it broadcasts below: the strategy's entries, not its model's own
            state = {**state, **{k: overrides[k].detach().to(state[k].device, state[k].dtype) for k in own}}
    sources = strategy.model_sources(up, comm.step or 0) or up
    for flat, tensors in flatten_by_dtype(state[k] for k in averaged):  # flat copies: the model is untouched
        mean_over(flat, sources, comm)
        if result:
            unflatten_into(flat, tensors)
    if own and up[0] != 0:  # node 0 is down: its copy of the strategy's global entries is stale
        for flat, tensors in flatten_by_dtype(state[k] for k in own):
            comm.broadcast(flat, up[0], comm.world)
            if result:
                unflatten_into(flat, tensors)
    return state if result else None


def _global_entries(entries: dict[str, torch.Tensor], strategy) -> dict[str, torch.Tensor]:
    overrides = dict(strategy.global_state() or {})
    unknown = set(overrides) - set(entries)
    if unknown:
        raise KeyError(f"{type(strategy).__name__}.global_state() returned keys not in the model: {sorted(unknown)}")
    return overrides


def _averaged_keys(state: dict[str, torch.Tensor], overrides: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in state.items() if k not in overrides and v.is_floating_point()]


@torch.no_grad()
def mean_over(flat: torch.Tensor, members: tuple[int, ...] | list[int], comm: Transport) -> None:
    """In place, the mean of `flat` over the nodes `members`; every node calls it (those outside add zeros).
    Uncounted: for measurements, which every node joins whether or not its own copy counts."""
    if len(members) == comm.num_nodes:
        comm.all_reduce(flat, ReduceOp.AVG, comm.world)
        return
    if comm.rank not in members:
        flat.zero_()
    comm.all_reduce(flat, ReduceOp.SUM, comm.world)
    flat.div_(len(members))
