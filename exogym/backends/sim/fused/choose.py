"""execution="sequential" | "fused" | "auto": checked and decided before any node starts.

"fused" first runs one unbatched and one batched forward/backward on throwaway copies, so that a
model vmap cannot run (data-dependent control flow, in-place writes to its inputs, an op without a
batching rule that cannot run under vmap) is a ValueError naming the reason before training.

"auto" picks fused only where it measured faster: the same probe, timed. On throwaway copies of the
model and node 0's first batch it times K sequential forward/backward passes and optimizer steps against
one batched pass and the optimizer steps fused runs take (exogym.backends.sim.fused.kernel: SGD, Adam and AdamW
with torch's fused kernel; sequential DDP steps its one replica once), one warm-up, then the fastest of
`_REPEATS` each, interleaved, and fuses when the batched side takes less than `_MARGIN` of the sequential time.
Collectives, and other optimizers' steps, cost the same either way. Where fusing cannot run or does not pay, "auto" runs
sequential and says why, once per run (a FusedFallbackWarning, or the announcement line).
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from exogym.data.sharding import move_to_device
from exogym.engine.execution import EXECUTIONS, FusedFallbackWarning
from exogym.engine.forward_backward import accumulate, minibatches
from exogym.backends.sim.fused.engine import FusedEngine, NodeWork, _forked_rng
from exogym.backends.sim.fused.kernel import FUSED_KERNEL, prefer_fused_kernel

__all__ = ["EXECUTIONS", "FusedFallbackWarning", "choose_execution"]

_REPEATS = 2
_MARGIN = 0.95  # fused must be at least 5% faster in the probe: probe noise must not make "auto" slower


class _NotBatchable(Exception):
    """The batched forward/backward failed (its cause says why); the unbatched one ran."""


def choose_execution(execution: str, *, model: torch.nn.Module, first_batch: Callable[[], Any],
                     num_nodes: int, devices: Sequence[torch.device], backend: str, minibatch_size: int, autocast: bool,
                     seed: int, resume_from: str | os.PathLike | None = None,
                     optim_spec: Any = None, one_replica: bool = False) -> tuple[str, str]:
    """("sequential" | "fused", why). Raises ValueError for a bad value or, under "fused", a model or run
    that cannot be fused. first_batch() gives node 0's first batch (drawn only for a probe). A resumed
    run under "auto" keeps the execution of the run it continues (fused and sequential runs draw dropout
    masks differently, so only that resumes bit-identically; an explicit other one is refused by the
    resume check, since execution is part of the run's fingerprint). one_replica: the strategy's sequential nodes
    share one replica (DDP) and take one optimizer step between them, where fused nodes take one each."""
    if execution not in EXECUTIONS:
        raise ValueError(f"execution must be one of {list(EXECUTIONS)}, got {execution!r}")
    saved = _checkpointed_execution(resume_from) if resume_from is not None else None
    if saved is not None and execution == "auto":
        execution = saved
    if execution == "sequential":
        return "sequential", "requested"
    reason = _static_obstacle(model, num_nodes, devices, backend)
    if reason is None:
        try:
            timing = _probe(model, first_batch(), num_nodes, devices[0], minibatch_size, autocast, seed,
                            timed=execution == "auto", optim_spec=optim_spec, one_replica=one_replica)
        except _NotBatchable as e:
            reason = _explain(e.__cause__)
    if reason is not None:
        if execution == "fused":
            raise ValueError(f"execution='fused' cannot run here: {reason}; use execution='sequential' "
                             "(or 'auto', which falls back to it)")
        warnings.warn(f"execution='auto' runs the nodes sequentially: {reason}", FusedFallbackWarning,
                      stacklevel=3)
        return "sequential", reason
    if execution == "fused":
        return "fused", "requested"
    fused_s, seq_s = timing
    what = "forward/backward and optimizer step" if _stepped(optim_spec, one_replica) else "forward/backward"
    seq_steps = " (one optimizer step: one replica)" if one_replica and _stepped(optim_spec, one_replica) else ""
    why = (f"probe: one batched {what} of {num_nodes} nodes took {fused_s * 1e3:.1f} ms, "
           f"{num_nodes} sequential ones {seq_s * 1e3:.1f} ms{seq_steps}")
    if fused_s < _MARGIN * seq_s:
        return "fused", why
    warnings.warn(f"execution='auto' runs the nodes sequentially: fusing is not faster here ({why})",
                  FusedFallbackWarning, stacklevel=3)
    return "sequential", why


def _explain(e: Exception) -> str:
    """Why vmap could not run the model, in the user's terms, then torch's own words."""
    text = str(e).splitlines()[0].rstrip(". ") if str(e) else type(e).__name__
    low = text.lower()
    if "data-dependent control flow" in low or ".item()" in low:
        why = "its forward uses a tensor's value in Python control flow (if/while on a tensor, .item(), bool())"
    elif "inplace" in low or "in-place" in low:
        why = "its forward writes in place into a tensor shared by all nodes (an input or a tensor it created)"
    elif "batching rule" in low:
        why = "it calls an op that torch.func.vmap has no batching rule for"
    else:
        why = "torch.func.vmap cannot run its forward/backward"
    return f"{why} (vmap: {type(e).__name__}: {text})"


def _checkpointed_execution(path: str | os.PathLike) -> str | None:
    """The execution recorded in a checkpoint's manifest (None: older than the option). A missing or corrupt
    checkpoint is a CheckpointError here already, before "auto" would spend a probe on a run that cannot start."""
    from exogym.runs.checkpoint import find_checkpoint, read_manifest

    found = read_manifest(find_checkpoint(path))["config"].get("execution")
    return found if found in ("sequential", "fused") else None


def _static_obstacle(model: torch.nn.Module, num_nodes: int, devices: Sequence[torch.device],
                     backend: str) -> str | None:
    if backend != "sim":
        return f"fused execution batches the nodes of one process (backend='sim'), got backend={backend!r}"
    if len(set(devices)) > 1:
        return (f"fused execution keeps every node on one device, got devices {sorted(map(str, set(devices)))}")
    if any(p.is_sparse for p in model.parameters()):
        return "the model has sparse parameters, which cannot be stacked"
    return None


def _joinable(optim_spec: Any) -> bool:
    from exogym.strategy.optim import OptimSpec

    return isinstance(optim_spec, OptimSpec) and optim_spec.cls in FUSED_KERNEL


def _stepped(optim_spec: Any, one_replica: bool) -> bool:
    """Whether the probe takes optimizer steps: where fused and sequential runs step differently (fused steps
    SGD/Adam/AdamW with the fused kernel; sequential DDP steps its one replica once), not where both step per node."""
    return optim_spec is not None and hasattr(optim_spec, "build") and (one_replica or _joinable(optim_spec))


def _probe(model: torch.nn.Module, batch: Any, k: int, device: torch.device, minibatch_size: int, autocast: bool,
           seed: int, *, timed: bool, optim_spec: Any = None, one_replica: bool = False) -> tuple[float, float] | None:
    """One unbatched forward/backward (checks the model contract) and one batched one over k copies; with
    `timed`, the fastest of _REPEATS of each (seconds for all k nodes). Each side takes the optimizer steps its
    execution takes where the two differ (_stepped): fused runs step SGD, Adam and AdamW with torch's fused kernel
    (exogym.backends.sim.fused.kernel), sequential runs with the optimizer's own implementation, k steps, or one
    where the nodes share one replica (one_replica: DDP)."""
    from exogym.engine.model_call import model_caller, parse_model_output

    batch = move_to_device(batch, device)
    engine = FusedEngine(model, k, device, minibatch_size=minibatch_size, autocast=autocast, seed=seed)
    copies = [copy.deepcopy(engine.template).train() for _ in range(k)]
    stepped = _stepped(optim_spec, one_replica)
    optims = [optim_spec.build(m) for m in copies[:1 if one_replica else k]] if stepped else []  # sequential's
    fused_optims = [optim_spec.build(m) for m in copies] if stepped else []  # as fused runs step (their kernel)
    if stepped and _joinable(optim_spec):
        for o in fused_optims:
            prefer_fused_kernel(o)
    parts = minibatches(batch, minibatch_size)
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    call = model_caller(engine.template, batch)  # model(batch), or model(**batch) for a keyword batch

    def sequential() -> None:
        for m in copies:
            def step(i: int, weight: float | None, m=m) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                with ctx():
                    loss, metrics = parse_model_output(call(m, parts[i]))
                (loss if weight is None else loss * weight).backward()
                return loss, metrics

            accumulate(parts, step)
        for o in optims:
            o.step()
        for m in copies:
            m.zero_grad(set_to_none=True)

    def fused() -> None:
        engine.run_group([NodeWork(r, 1, m, batch) for r, m in enumerate(copies)])
        for o in fused_optims:
            o.step()
        for m in copies:
            m.zero_grad(set_to_none=True)

    with _forked_rng(device), torch.enable_grad():
        sequential()  # the contract first: a model that breaks it gets the sequential run's own message
        try:
            fused()
        except Exception as e:
            raise _NotBatchable() from e
        if not timed:
            return None
        best = {"fused": float("inf"), "sequential": float("inf")}
        for _ in range(_REPEATS):
            for name, fn in (("fused", fused), ("sequential", sequential)):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                fn()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best[name] = min(best[name], time.perf_counter() - started)
    return best["fused"], best["sequential"]
