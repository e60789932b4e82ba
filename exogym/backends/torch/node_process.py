"""The torch backend inside one process: one node on torch.distributed, once the launcher has brought its process
group up (a local spawn or torchrun: the body is the same); `TORCH` is the backend as a launcher sees it."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from exogym.backends.hosting import Hosting, Peers, ProcessBackend, process_group_timeout
from exogym.backends.peer_watch import PeerWatch
from exogym.backends.torch.heartbeat import Heartbeat
from exogym.backends.torch.transport import TorchTransport
from exogym.backends.errors import PeerLostError
from exogym.comm.transport import CollectiveError, bind_transport
from exogym.engine.global_model import global_state_dict
from exogym.engine.node import keep_completed_rows

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan, RunSinks

__all__ = ["run_node", "run_hosted", "pick_backend", "TORCH"]


def pick_backend(devices: Sequence[torch.device]) -> str:
    """nccl when every node has a GPU of its own; gloo otherwise (CPU, MPS, or GPUs shared by several nodes)."""
    if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


_runs_started = 0  # per process: keys in a store shared by several runs (torchrun: one per job) stay apart


def run_node(plan: "RunPlan", live: Any, rank: int, backend: str, start_time: float, timeout: timedelta,
             store: Any = None, peers: PeerWatch | None = None) -> tuple[Any, TorchTransport, Any, Any]:
    """The body of one node's process, once its process group is up: returns (node, comm, log, state or None).
    `live`: where the node's rows go. `store`: a client of the run's key-value store, where this node's heartbeat
    goes (None: none). `peers`: the other processes' beats, which a waiting collective watches (None: none)."""
    global _runs_started
    _runs_started += 1
    device = plan.devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = TorchTransport(rank, plan.num_nodes, device=device, backend=backend, timeout=timeout,
                          time_model=plan.cfg.time_model)
    if peers is not None:
        comm.check_peers = peers.check
    if store is not None:
        comm.heartbeat = Heartbeat(store, rank, comm.ledger, lambda: comm.step, timeout.total_seconds(),
                                   prefix=f"exogym/heartbeat/{_runs_started}").start()
    node = None
    try:
        node = plan.make_node(rank, start_time, live)
        plan.node_rng(rank).activate()  # this process is the node: its streams stay in place for the whole run
        log, state = node.run(comm)
    except BaseException:
        keep_completed_rows([node] if node is not None else [])
        raise
    finally:
        if comm.heartbeat is not None:
            comm.heartbeat.stop()
    return node, comm, log, state


def _heartbeat_store(peers: Peers) -> Any:
    """A client of the run's store for the heartbeat; None if unreachable (the run works without it; a timeout then
    names only the waiting node)."""
    try:
        return dist.TCPStore(peers.address, peers.port, is_master=False, timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001
        return None


def run_hosted(plan: "RunPlan", sinks: "RunSinks", hosting: Hosting, peers: Peers | None) -> list[Any]:
    """What one process of a torch run does: its one node.

    Args:
        plan: the run.
        sinks: where the node's rows go.
        hosting: the node this process holds; returns_model: every process takes part in one more (uncounted)
            average, so that each returns the global model (node.run hands it to node 0 only).
        peers: the process group's store.

    Returns:
        [(log, state)]: the node's log, and the global model's state where this process holds it, else None.
    """
    rank = hosting.nodes.start
    device = plan.devices[rank]
    # The process group decides where collectives run (the launcher's choice, or a script's own group under torchrun).
    backend = "nccl" if device.type == "cuda" and "nccl" in str(dist.get_backend()) else "gloo"
    store = _heartbeat_store(peers)
    # Every node's process beats; a collective waiting on a process whose beat stopped for fit's peer_timeout names
    # it (PeerLostError) instead of waiting out the process group's timeout (gloo: nccl's waits are not cut short).
    watch = (PeerWatch(store, f"{peers.run_key}/peers", hosting.process, hosting.owner, plan.peer_timeout)
             if store is not None and hosting.processes > 1 and backend == "gloo" else None)
    try:
        node, comm, log, state = run_node(plan, sinks.live, rank, backend, peers.start, peers.timeout, store, watch)
        if hosting.returns_model and (getattr(node.strategy, "sends_messages", False) or comm.served() is not None):
            # The global model of a strategy with messages is node 0's, computed before the messages ended (a rank
            # other than 0 reads the server through them: exogym.backends.torch.server_reads): every rank takes it.
            box = [state]
            dist.broadcast_object_list(box, src=0)
            state = box[0]
        elif hosting.returns_model:
            with bind_transport(comm):
                everyone = global_state_dict(node.model, node.strategy, comm)
            state = everyone if state is None else state
        if watch is not None:
            watch.finished()
    finally:
        if watch is not None:
            watch.close()
    return [(log, state)]


def _group_timeout(plan: "RunPlan") -> timedelta:
    # How long a collective may wait for the other members before torch.distributed gives up is fit's node_timeout.
    # A node that raises or dies ends a local run at once anyway; this bounds what cannot be seen from outside: a
    # node that never reaches a collective, or nodes deadlocked in mismatched ones, which the error then names
    # (exogym.backends.torch.heartbeat).
    return process_group_timeout(plan.node_timeout)


TORCH = ProcessBackend("torch", run_hosted, one_node_per_process=True, group_backend=pick_backend,
                       group_timeout=_group_timeout, passthrough=(CollectiveError, PeerLostError))
