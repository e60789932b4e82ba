"""The sim backend's run: K nodes (or one process's block of them) as cooperative threads of this thread, under one
baton; `SIM` is the backend as a launcher sees it."""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence

import torch

from exogym.runs.checkpoint_checks import CheckpointError
from exogym.backends.hosting import SERVER_ROLE, Hosting, Peers, ProcessBackend, process_group_timeout
from exogym.backends.sim.alone import AloneCheck
from exogym.backends.sim.baton import Baton
from exogym.backends.sim.exchange import Exchange
from exogym.backends.sim.fused.choose import choose_execution
from exogym.backends.sim.fused.engine import FusedEngine
from exogym.backends.sim.fused.execution import FusedExecution
from exogym.backends.sim.postlink import Keeper
from exogym.backends.sim.postoffice import PostOffice
from exogym.backends.sim.postproxy import PostProxy
from exogym.backends.sim.transport import SimTransport
from exogym.backends.errors import NodeTimeoutError, PeerLostError
from exogym.comm.transport import CollectiveError
from exogym.engine.execution import SequentialExecution
from exogym.engine.node import keep_completed_rows
from exogym.engine.rng import NumpyBaton

if TYPE_CHECKING:
    from exogym.backends.sim.protocols import Messages
    from exogym.engine.plan import RunPlan, RunSinks

__all__ = ["run_sim", "run_hosted", "SIM", "KeepOnceStore"]


class KeepOnceStore:
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


def _post_office(plan: "RunPlan", baton: Baton, exchange: Exchange | None, keeper: int | None) -> "Messages":
    """The nodes' post office: the one event queue and the server (one process, or the keeper: the process hosting the
    server role), or a proxy forwarding to the keeper (exogym.backends.sim.postlink)."""
    k, time_model = plan.num_nodes, plan.cfg.time_model
    if exchange is not None and keeper is not None and keeper != exchange.me:
        return PostProxy(baton, k, time_model, exchange, keeper)
    # On shared links a collective's transfer is a flow of the post office's; over processes, of the keeper's (a
    # strategy that sends messages), or costed alone by its formula and checked (exogym.backends.sim.alone).
    post = PostOffice(baton, k, time_model)
    if exchange is not None and keeper is not None:
        post.keeper = Keeper(post, exchange, exchange.owner, exchange.me)
    post.undeclared = exchange is not None and keeper is None
    saved = plan.resume[0] if plan.resume is not None else None
    if saved is not None and "messages" in saved.strategy:  # in before any node runs (or another process posts)
        try:
            post.load_state_dict(saved.strategy["messages"])
        except (KeyError, IndexError, TypeError, ValueError) as e:  # what checkpoint_checks does not know (flows)
            raise CheckpointError(f"node 0's checkpointed messages in flight do not load ({type(e).__name__}: {e}); "
                                  "the file was changed after it was written: resume from an earlier checkpoint") \
                from e
    return post


def run_sim(plan: "RunPlan", sinks: "RunSinks", *, local: Sequence[int] | None = None,
            exchange: Exchange | None = None, keeper: int | None = None) -> list[Any]:
    """Run the plan's nodes under one baton on this thread.

    Args:
        plan: the run.
        sinks: where the nodes report (the run's live log; on_stuck, which lets the watchdog end the process).
        local: the block of nodes this process runs (default: all of them).
        exchange: the crossings to the other processes' nodes, when local is a block.
        keeper: the process hosting the server role, whose post office holds the run's event queue (None: the run has no
            messages across processes).

    Returns:
        The nodes' (log, state) pairs in rank order.
    """
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
        sinks.on_stuck(error)

    baton = Baton(k, on_resume=resume, on_pause=pause, node_timeout=plan.node_timeout, step_of=lambda r: comms[r].step,
                  local=local, exchange=exchange, on_stuck=on_stuck if sinks.on_stuck is not None else None,
                  clock_of=lambda r: comms[r].clock.now)
    baton.messages = _post_office(plan, baton, exchange, keeper)
    owner = exchange.owner if exchange is not None else None
    time_model = plan.cfg.time_model
    alone = (AloneCheck(baton.floor) if exchange is not None and time_model is not None
             and time_model.network.shared_links and not plan.strategy.sends_messages else None)
    comms.update((r, SimTransport(baton, r, k, time_model, plan.cfg.membership, owner, alone)) for r in local)
    # the lookahead across processes: a proxy tells the keeper its nodes' least clock as they step, the keeper lets events
    # happen while its nodes step (exogym.backends.sim.postlink)
    if isinstance(baton.messages, PostProxy):
        baton.messages.watch(comms)
    elif isinstance(baton.messages, PostOffice) and baton.messages.keeper is not None:
        baton.messages.keeper.watch(comms)
    execution = SequentialExecution() if plan.execution == "sequential" else FusedExecution(FusedEngine(
        plan.model, len(local), plan.devices[local[0]], minibatch_size=plan.cfg.minibatch_size,
        autocast=plan.cfg.autocast, seed=plan.seed, baton=baton, first_rank=local[0]))
    keep_once = KeepOnceStore()  # one store for this process's nodes: what every node holds identically is held once

    def node_body(r: int) -> Any:
        # The node's model and strategy are copied on its first turn, not all K up front: state a strategy keeps
        # once (DDP's replica) then never exists K times, not even at the start.
        node = nodes[r] = plan.make_node(r, start, sinks.live, execution=execution, keep_once=keep_once)
        return node.run(comms[r])

    try:
        results = baton.run([lambda r=r: node_body(r) for r in local])
    except BaseException:
        keep_completed_rows(nodes.values())
        raise
    finally:
        caller.apply()
    if exchange is not None:  # a run over several processes: how long this one's nodes all waited on the others
        for log, _ in results:
            log.comm["process_waited_s"] = baton.waited_s
    return results



def run_hosted(plan: "RunPlan", sinks: "RunSinks", hosting: Hosting, peers: Peers | None) -> list[Any]:
    """What one process of a sim run does: its block of nodes, with an exchange to the other processes' blocks.

    Args:
        plan: the run.
        sinks: where this process's nodes report.
        hosting: the nodes this process holds, and which process holds each of the others.
        peers: the other processes' store (None: the run is this process alone).

    Returns:
        This process's nodes' (log, state) pairs in rank order.
    """
    if peers is None:
        return run_sim(plan, sinks)
    exchange = Exchange(hosting.owner, hosting.process, peers.store, peers.run_key, peer_timeout=plan.peer_timeout)
    try:
        return run_sim(plan, sinks, local=hosting.nodes, exchange=exchange, keeper=hosting.role_process(SERVER_ROLE))
    finally:
        exchange.close()


def _group_backend(devices: Sequence[torch.device]) -> str:
    return "gloo"  # a crossing moves host memory: gloo's point-to-point messages


def _group_timeout(plan: "RunPlan") -> Any:
    # No message waits out a timeout: a stuck node is named by its process's watchdog (node_timeout), a collective
    # that never completes by the exchange's deadlock check, a dead process by the caller at once.
    return process_group_timeout(None)


SIM = ProcessBackend("sim", run_hosted, one_node_per_process=False, group_backend=_group_backend,
                     group_timeout=_group_timeout, passthrough=(CollectiveError, NodeTimeoutError, PeerLostError),
                     processes_take_gpus=True, choose_execution=functools.partial(choose_execution, backend="sim"))
