"""One node's process on torch.distributed, once its process group is up: the body both ways in share (a torchrun
launch and the local spawn), the process group's backend and its timeout."""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from exogym.backends.torch.heartbeat import Heartbeat
from exogym.backends.torch.transport import TorchTransport
from exogym.engine.node import keep_completed_rows

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan

__all__ = ["run_node", "pick_backend", "process_group_timeout", "PROCESS_GROUP_TIMEOUT", "peak_rss_mb"]

# How long a collective may wait for the other members before torch.distributed gives up is fit's node_timeout (the
# sim's watchdog limit, default 600 s). A node that raises or dies ends a local run at once anyway; this bounds what
# cannot be seen from outside: a node that never reaches a collective, or nodes deadlocked in mismatched ones, which
# the error then names (exogym.backends.torch.heartbeat). node_timeout=None asks for no limit; torch.distributed
# needs a finite one, so that is PROCESS_GROUP_TIMEOUT (a week).
PROCESS_GROUP_TIMEOUT = timedelta(days=7)


def process_group_timeout(node_timeout: float | None) -> timedelta:
    """The process group's timeout for fit's node_timeout (seconds; None: PROCESS_GROUP_TIMEOUT)."""
    return PROCESS_GROUP_TIMEOUT if node_timeout is None else timedelta(seconds=node_timeout)


def pick_backend(devices: Sequence[torch.device]) -> str:
    """nccl when every node has a GPU of its own; gloo otherwise (CPU, MPS, or GPUs shared by several nodes)."""
    if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


_runs_started = 0  # per process: keys in a store shared by several runs (torchrun: one per job) stay apart


def run_node(plan: "RunPlan", rank: int, backend: str, start_time: float, timeout: timedelta,
              store: Any = None) -> tuple[Any, TorchTransport, Any, Any]:
    """The body of one node's process, once its process group is up: returns (node, comm, log, state or None).
    `store`: a client of the run's key-value store, where this node's heartbeat goes (None: none)."""
    global _runs_started
    _runs_started += 1
    device = plan.devices[rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = TorchTransport(rank, plan.num_nodes, device=device, backend=backend, timeout=timeout,
                             time_model=plan.cfg.time_model)
    if store is not None:
        comm.heartbeat = Heartbeat(store, rank, comm.ledger, lambda: comm.step, timeout.total_seconds(),
                                   prefix=f"exogym/heartbeat/{_runs_started}").start()
    node = None
    try:
        node = plan.make_node(rank, start_time)
        plan.node_rng(rank).activate()  # this process is the node: its streams stay in place for the whole run
        log, state = node.run(comm)
    except BaseException:
        keep_completed_rows([node] if node is not None else [])
        raise
    finally:
        if comm.heartbeat is not None:
            comm.heartbeat.stop()
    log.comm["process_peak_rss_mb"] = peak_rss_mb()  # the caller's record measures one process; each node is one
    return node, comm, log, state


def peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux
