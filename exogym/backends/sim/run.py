"""The sim backend's run: K nodes as cooperative threads of this thread, under one baton."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import torch

from exogym.backends.sim.baton import Baton
from exogym.backends.sim.exchange import Exchange
from exogym.backends.sim.fused.engine import FusedEngine
from exogym.backends.sim.fused.execution import FusedExecution
from exogym.backends.sim.postoffice import PostOffice
from exogym.backends.sim.transport import SimTransport
from exogym.engine.execution import SequentialExecution
from exogym.engine.node import keep_completed_rows
from exogym.engine.rng import NumpyBaton

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan

__all__ = ["run_sim", "KeptOnce"]


class KeptOnce:
    """The store behind NodeContext.keep_once for the nodes of one sim run: one object per key, made by the first
    node to ask (DDP's replica, DiLoCo's outer model, SPARTA's permutations), shared by every node after it."""

    def __init__(self) -> None:
        self._objects: dict[Hashable, Any] = {}

    def __call__(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self._objects:
            self._objects[key] = make()
        return self._objects[key]


class _NodeModes:
    """A node's share of torch's per-thread state (grad mode, autocast), swapped with the baton
    because all sim nodes run on the caller's OS thread."""

    def __init__(self, device_types: tuple[str, ...]):
        self.device_types = device_types
        self.grad = True
        self.autocast = {d: (False, torch.get_autocast_dtype(d)) for d in device_types}

    def capture(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in self.device_types}

    def apply(self) -> None:
        torch.set_grad_enabled(self.grad)
        for d, (enabled, dtype) in self.autocast.items():
            torch.set_autocast_enabled(d, enabled)
            torch.set_autocast_dtype(d, dtype)


def run_sim(plan: "RunPlan", *, local: Sequence[int] | None = None, exchange: Exchange | None = None
            ) -> list[Any]:
    """Run the plan's nodes (or the block `local`, one process's share of a run over several, with the `exchange`
    to the others) under one baton on this thread; return their results in rank order."""
    start = time.perf_counter()
    k = plan.num_nodes
    local = list(range(k)) if local is None else list(local)
    numpy_stream = NumpyBaton()  # numpy's stream, handed from node to node
    rngs = {r: plan.node_rng(r, numpy_stream) for r in local}
    device_types = tuple(sorted({"cpu", *(d.type for d in plan.devices)}))
    modes = {r: _NodeModes(device_types) for r in local}
    caller = _NodeModes(device_types)
    caller.capture()

    def resume(r: int) -> None:
        rngs[r].activate()
        modes[r].apply()

    def pause(r: int) -> None:
        rngs[r].deactivate()
        modes[r].capture()

    comms: dict[int, SimTransport] = {}
    nodes: dict[int, Any] = {}

    def on_stuck(error: BaseException) -> None:  # the process is about to end: the nodes' last rows first
        keep_completed_rows(nodes.values())
        plan.on_stuck(error)

    baton = Baton(k, on_resume=resume, on_pause=pause, node_timeout=plan.node_timeout, step_of=lambda r: comms[r].step,
                  local=local, exchange=exchange, on_stuck=on_stuck if plan.on_stuck is not None else None)
    baton.post = PostOffice(baton, k, plan.cfg.time_model, spans_processes=exchange is not None)
    owner = exchange.owner if exchange is not None else None
    comms.update((r, SimTransport(baton, r, k, plan.cfg.time_model, plan.cfg.membership, owner)) for r in local)
    execution = SequentialExecution() if plan.execution == "sequential" else FusedExecution(FusedEngine(
        plan.model, len(local), plan.devices[local[0]], minibatch_size=plan.cfg.minibatch_size,
        autocast=plan.cfg.autocast, seed=plan.seed, baton=baton, first_rank=local[0]))
    keep_once = KeptOnce()  # one store for this process's nodes: what every node holds identically is held once

    def node_body(r: int) -> Any:
        # The node's model and strategy are copied on its first turn, not all K up front: state a strategy keeps
        # once (DDP's replica) then never exists K times, not even at the start.
        node = nodes[r] = plan.make_node(r, start, execution=execution, keep_once=keep_once)
        return node.run(comms[r])

    try:
        return baton.run([lambda r=r: node_body(r) for r in local])
    except BaseException:
        keep_completed_rows(nodes.values())
        raise
    finally:
        caller.apply()

