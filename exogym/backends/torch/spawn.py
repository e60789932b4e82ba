"""The torch backend's local spawn: one OS process per node on this machine, supervised from the caller.

How node processes start, and why not 'fork': a forked copy of the caller inherits its threads' half-held locks
(torch's OpenMP pool, loggers, a progress bar) and cannot use CUDA once the caller has; and fork is unsafe on
macOS. So node processes start clean: on Linux from a forkserver, a fresh single-threaded process that imports
torch once and forks a node process per run in milliseconds; elsewhere (macOS, Windows) with 'spawn', a fresh
interpreter per node (a few seconds each: torch.optim alone imports torch._dynamo on first use). Either way the
run must pickle: the model, the datasets and the strategy are sent to each process (tensors through shared memory,
not copied), so they must be defined at module level of an importable file, which is checked before any process
starts, and a script must call fit() under `if __name__ == "__main__":`. A forkserver keeps the environment
variables it started with, for every later run of the calling process.

How the caller learns what happens: each node process has a pipe to the caller and sends its log rows as it
flushes them (the caller feeds the run's logger, as the sim backend does), then its NodeLog and, node 0, the
global model on the CPU, or its exception with the traceback. The caller waits on the pipes, so a node that raises
or dies is seen at once: the others are ended and the run fails, naming the node. Nothing waits forever: once a
node has finished, the others get a grace period (they only have the final average left), and collectives time
out after fit's node_timeout, and the error names the node(s) that never came (torch_heartbeat.py).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from exogym.backends.errors import NodeProcessError
from exogym.comm.transport import CollectiveError
from exogym.backends.local_processes import (HOST, ForwardingLive, Outbox, check_picklable, process_context,
                                             stop_on_sigterm, supervise, wind_down, with_rows, without_rows)
from exogym.backends.torch.node_process import pick_backend, process_group_timeout, run_node

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan
    from exogym.runs.record import NodeLog

__all__ = ["run_spawned", "NodeProcessError"]



def run_spawned(plan: "RunPlan") -> list[tuple["NodeLog", dict[str, torch.Tensor] | None]]:
    """Start one process per node, feed the plan's live log from their rows, return their results in rank order."""
    k = plan.num_nodes
    node_plan = dataclasses.replace(plan, live=None, on_stuck=None)  # each process forwards its rows here instead
    check_picklable(node_plan, "backend='torch'", "each node's process")
    backend = pick_backend(plan.devices)
    # The store is the rendezvous point; listening on port 0 lets the OS pick a free port, with no race.
    timeout = process_group_timeout(plan.node_timeout)
    store = dist.TCPStore(HOST, plan.port or 0, is_master=True, wait_for_workers=False, timeout=timeout)
    threads = max(1, torch.get_num_threads() // k)  # the nodes share the caller's CPU threads
    ctx = process_context()
    start = time.perf_counter()  # one machine, one clock: the nodes' wall times count from here, as in the sim
    procs, conns, finished = [], [], False
    try:
        for rank in range(k):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_node_main, name=f"exogym-node-{rank}",
                               args=(rank, node_plan, store.port, backend, writer, start, threads, timeout))
            proc.start()
            writer.close()  # the node holds the only writer now: end of file on the reader means it is gone
            procs.append(proc)
            conns.append(reader)
        results = supervise(plan.live, procs, conns, [f"node {r}" for r in range(k)], passthrough=(CollectiveError,))
        finished = True
        return [(with_rows(log, plan.live), state) for log, state in results]
    finally:
        wind_down(plan.live, procs, conns, finished=finished)
        del store


# ---- inside a node's process ------------------------------------------------------------------------------------

def _node_main(rank: int, plan: "RunPlan", port: int, backend: str, conn: Connection, start: float,
               threads: int, timeout: timedelta) -> None:
    """A node process: join the process group, run the node, report; on any exception report it and exit."""
    outbox = Outbox(conn)
    try:
        stop_on_sigterm()
        torch.set_num_threads(threads)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=plan.num_nodes, timeout=timeout)
        plan.live = ForwardingLive(outbox)
        heartbeat_store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=30))
        _, _, log, state = run_node(plan, rank, backend, start, timeout, heartbeat_store)
        state = None if state is None else {k: v.detach().cpu() for k, v in state.items()}
        outbox.send("done", without_rows(log), state)
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller, even KeyboardInterrupt
        try:
            outbox.send_error(rank, e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # now: skip interpreter teardown, which could block on a process group mid-collective
    dist.destroy_process_group()
    conn.close()


