"""Fused node execution: the nodes that compute in a step run one batched forward/backward.

A node reaching its forward/backward parks at the compute rendezvous (`Baton.park`: no bytes,
no simulated time). When no node can run any more, the baton hands the parked ones to
`FusedEngine.run_parked`, which groups them by batch signature and, per group, runs
`torch.func.functional_call` of one template module under `vmap` over the members' stacked
parameters and buffers (exogym.backends.sim.fused.stacked); each member's `.grad` is then its slice of the
stacked gradient. Only nodes that compute join: a node that is down or sits the step out
(FedAvg's unsampled clients) never parks, and a group of ranks that is not a contiguous run is
gathered and its buffers written back.

Random streams: the batched step draws from one stream seeded from (seed, step, members), not from
the nodes' own streams (vmap draws one mask for all members at once: randomness="different").
Runs are deterministic and resume bit-identically, but node r's dropout masks differ from the
sequential run's and depend on which nodes compute with it; the nodes' own streams (used by
strategies, e.g. client sampling or SPARTA's index choice) are untouched by the model.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from exogym.backends.sim.fused.attention import fold_attention
from exogym.backends.sim.fused.layers import batching_friendly
from exogym.backends.sim.fused.kernel import adopt_fused_kernel
from exogym.backends.sim.fused.stacked import NodeStacks
from exogym.engine.execution import batch_signature
from exogym.engine.forward_backward import accumulate, minibatches
from exogym.engine.model_call import parse_model_output, takes_keyword_batch

if TYPE_CHECKING:
    from exogym.backends.sim.baton import Baton

__all__ = ["FusedEngine", "NodeWork"]


@dataclass
class NodeWork:
    """One node's request at the compute rendezvous, and what the batched step hands back."""

    rank: int
    step: int
    model: torch.nn.Module
    batch: Any
    result: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
    seconds: float = 0.0  # the member's share of the batched step's wall time
    extra: dict = field(default_factory=dict)


def _stack_batches(batches: list[Any]) -> tuple[list[torch.Tensor], Any, list[Any]]:
    """Members' batches (same signature) -> stacked tensor leaves [M, ...], the tree spec, and all leaves of
    the first batch (non-tensor leaves are shared)."""
    flat = [tree_flatten(b)[0] for b in batches]
    _, spec = tree_flatten(batches[0])
    stacked = [torch.stack([f[i] for f in flat]) for i, x in enumerate(flat[0]) if isinstance(x, torch.Tensor)]
    return stacked, spec, flat[0]


class FusedEngine:
    """Runs the parked nodes' forward/backward as one vmapped computation per batch signature."""

    def __init__(self, template: torch.nn.Module, num_nodes: int, device: torch.device, *, minibatch_size: int,
                 autocast: bool, seed: int, baton: Baton | None = None, first_rank: int = 0):
        self.template = copy.deepcopy(template).to(device)  # only its structure is used, under functional_call
        self._batched = batching_friendly(self.template)  # the same, with forwards that vmap batches well
        self.device, self.minibatch_size, self.autocast, self.seed = device, minibatch_size, autocast, seed
        self.stacks = NodeStacks(self.template, num_nodes, device, first=first_rank)  # this process's nodes
        self.baton = baton  # park() is how a node waits for the batched step (None: the probe, which parks none)
        self._parked: dict[int, NodeWork] = {}
        self.batched_steps = 0  # how many vmapped forward/backward groups ran (for tests and reports)
        # The attention fold is a TorchFunctionMode, which puts Python on every op's path: keep it only for
        # models whose first batched step called SDPA (on CUDA, vmap batches SDPA itself).
        self._fold: fold_attention | None = fold_attention() if device.type == "cpu" else None

    # --- node side -----------------------------------------------------------------------------------
    def forward_backward(self, rank: int, step: int, model: torch.nn.Module,
                         batch: Any) -> tuple[tuple[torch.Tensor, dict[str, torch.Tensor]], float]:
        """Called by node `rank` in place of its own forward/backward; returns ((loss, metrics), seconds)."""
        work = NodeWork(rank, step, model, batch)
        self._parked[rank] = work
        self.baton.park(rank, self.run_parked)  # returns after run_parked has filled in the result
        return work.result, work.seconds

    def adopt_optimizer(self, rank: int, model: torch.nn.Module, optim: Any) -> bool:
        """Node `rank`'s optimizer steps with torch's fused kernel where it left the choice to torch
        (exogym.backends.sim.fused.kernel)."""
        return adopt_fused_kernel(model, optim)

    def release(self, rank: int, model: torch.nn.Module) -> None:
        """Give node `rank`'s tensors storage of their own, before they are pickled (its optimizer's state is its
        own already)."""
        self.stacks.release(rank, model)

    def count_flops(self, model: torch.nn.Module, forward_backward) -> float:
        """FLOPs of one sequential forward/backward of `model`'s arithmetic, on a throwaway copy (the node's
        tensors, gradients and random streams are untouched), so fused runs count what sequential ones do."""
        probe = copy.deepcopy(self.template)
        probe.load_state_dict(model.state_dict())
        probe.train(model.training)
        with _forked_rng(self.device), FlopCounterMode(display=False) as counter:
            forward_backward(probe)
        return float(counter.get_total_flops())

    # --- the baton's side ------------------------------------------------------------------------------
    def run_parked(self, ranks: list[int]) -> None:
        """Compute every parked node's forward/backward (ranks: those parked, any order)."""
        works = [self._parked.pop(r) for r in sorted(ranks) if r in self._parked]
        groups: dict[tuple, list[NodeWork]] = {}
        for w in works:
            groups.setdefault(batch_signature(w.batch), []).append(w)
        for group in groups.values():
            try:
                self.run_group(group)
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note(f"(raised in the fused forward/backward of nodes {[w.rank for w in group]} at step "
                               f"{group[0].step}; execution='sequential' runs them one by one)")
                raise

    def run_group(self, group: list[NodeWork]) -> None:
        started = time.perf_counter()
        members = [w.rank for w in group]
        node_params = [self.stacks.sync(w.rank, w.model) for w in group]
        params, buffers, copied = self.stacks.gather(members)
        trainable = [n for n in params if self.stacks.trainable[n]]
        leaves = {n: (t.detach().requires_grad_() if n in trainable else t) for n, t in params.items()}
        parts = [minibatches(w.batch, self.minibatch_size) for w in group]  # every member's batch has the same size
        grads: list[torch.Tensor] | None = None
        training = group[0].model.training
        self._batched.train(training)
        seed = int(np.random.SeedSequence([self.seed, 0xF05ED, group[0].step, *members]).generate_state(1)[0])

        def step(i: int, weight: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            nonlocal grads
            stacked, spec, first = _stack_batches([p[i] for p in parts])
            with self._autocast(), (self._fold or contextlib.nullcontext()):
                loss, metrics = vmap(self._call(spec, first), randomness="different")(leaves, buffers, stacked)  # [M]
            if self._fold is not None and not self._fold.called:
                self._fold = None
            if not loss.requires_grad:
                raise TypeError("the loss returned by model(batch) does not require grad; compute it from the "
                                "model's parameters, outside torch.no_grad()")
            g = torch.autograd.grad((loss if weight is None else loss * weight).sum(),
                                    [leaves[t] for t in trainable], allow_unused=True)
            grads = list(g) if grads is None else [a if b is None else (b if a is None else a.add_(b))
                                                  for a, b in zip(grads, g)]
            return loss, metrics

        with _forked_rng(self.device), torch.enable_grad():
            torch.random.default_generator.manual_seed(seed)
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    torch.cuda.manual_seed(seed)
            total, totals = accumulate(parts[0], step)
        if copied:
            self.stacks.scatter_buffers(members, buffers)
        # Autograd may hand a stacked gradient back in another layout (F.linear's weight's comes transposed where
        # exogym.backends.sim.fused.layers keeps F.linear): one copy into the parameter's own layout, or every elementwise
        # optimizer op after it walks it strided. A no-op for a gradient already in that layout.
        grads = [None if g is None else g.contiguous() for g in grads or []]
        for j, w in enumerate(group):  # each node's .grad is its slice (accumulated onto any it had)
            named = node_params[j]
            for name, g in zip(trainable, grads):
                if g is None:
                    continue
                p = named[name]
                if p.grad is None:
                    p.grad = g[j]
                else:
                    p.grad.add_(g[j])
            w.result = (total[j], {k: v[j] for k, v in totals.items()})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        share = (time.perf_counter() - started) / len(group)
        for w in group:
            w.seconds = share
        self.batched_steps += 1

    def _call(self, spec, first: list[Any]):
        keywords = None

        def one_node(params: dict, buffers: dict, tensors: list[torch.Tensor]):
            nonlocal keywords
            it = iter(tensors)
            batch = tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in first], spec)
            if keywords is None:  # model(**batch) for a dict batch naming the forward's parameters (exogym.engine.model_call)
                keywords = takes_keyword_batch(self._batched, batch)
            args, kwargs = ((), batch) if keywords else ((batch,), None)
            # The contract was checked on an unbatched call before the run; under vmap a loss's requires_grad
            # reads False, so run_group checks it on the batched result.
            return parse_model_output(functional_call(self._batched, (params, buffers), args, kwargs), training=False)

        return one_node

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def _forked_rng(device: torch.device):
    """Whatever is drawn inside leaves the process-wide streams (the running node's) as they were."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield
