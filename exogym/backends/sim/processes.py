"""One simulation over several processes: fit(processes=P) spawns P local processes, or torchrun starts them
(backend="sim" with WORLD_SIZE > 1). Each process runs the sim over a contiguous block of the K nodes (sizes
differing by at most one), the collectives that span blocks cross between processes (exogym.backends.sim.exchange),
and the caller gets back what a one-process run returns: every node's log, in rank order, and the global model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from exogym.backends.local_processes import (HOST, ForwardingLive, Outbox, check_picklable, process_context,
                                             stop_on_sigterm, supervise, wind_down, with_rows, without_rows)
from exogym.backends.sim.exchange import Exchange, block_of, blocks
from exogym.backends.sim.run import run_sim
from exogym.backends.torch.node_process import peak_rss_mb, process_group_timeout
from exogym.backends.errors import NodeTimeoutError
from exogym.comm.transport import CollectiveError

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan

__all__ = ["run_sim_processes", "run_sim_launched", "threads_per_process", "own_gpu"]


def threads_per_process(processes: int) -> int:
    """Each process's share of this machine's torch threads (the caller's count, which a user may have set)."""
    return max(1, torch.get_num_threads() // processes)


def run_sim_processes(plan: "RunPlan", processes: int) -> list[Any]:
    """Spawn `processes` local processes, each simulating its block of nodes; feed the plan's live log from their
    rows; return every node's (log, state) in rank order."""
    spans = blocks(plan.num_nodes, processes)
    # Each process forwards its rows here instead, and reports a node stuck in native code before it exits.
    worker_plan = dataclasses.replace(plan, live=None, on_stuck=None)
    check_picklable(worker_plan, f"processes={processes}", "each simulating process")
    # No message waits out a timeout here: a stuck node is named by its process's watchdog (node_timeout), a
    # collective that never completes by the deadlock check, a dead process by the caller at once.
    timeout = process_group_timeout(None)
    store = dist.TCPStore(HOST, plan.port or 0, is_master=True, wait_for_workers=False, timeout=timeout)
    threads = threads_per_process(processes)
    ctx = process_context()
    start = time.perf_counter()
    procs, conns, finished = [], [], False
    try:
        for p in range(processes):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_process_main, name=f"exogym-sim-{p}",
                               args=(p, processes, worker_plan, store.port, writer, start, threads, timeout))
            proc.start()
            writer.close()  # the process holds the only writer now: end of file on the reader means it is gone
            procs.append(proc)
            conns.append(reader)
        labels = [f"process {p} (nodes {b.start}-{b.stop - 1})" for p, b in enumerate(spans)]
        per_process = supervise(plan.live, procs, conns, labels, [b.start for b in spans],
                                passthrough=(CollectiveError, NodeTimeoutError))
        finished = True
        return [(with_rows(log, plan.live), state) for (results,) in per_process for log, state in results]
    finally:
        wind_down(plan.live, procs, conns, finished=finished)
        del store


def _process_main(p: int, processes: int, plan: "RunPlan", port: int, conn: Connection, start: float, threads: int,
                  timeout: timedelta) -> None:
    """A simulating process: join the process group, run its block, report; on any exception report it and exit."""
    outbox = Outbox(conn)
    try:
        stop_on_sigterm()
        torch.set_num_threads(threads)
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=p, world_size=processes, timeout=timeout)
        plan.live = ForwardingLive(outbox)
        plan.on_stuck = lambda error: outbox.send_error(error.rank, error)  # then the watchdog ends this process
        plan.devices = own_gpu(plan.devices, p)
        results = _run_block(plan, p, processes, store, "exogym/sim", start)
        outbox.send("done", [(without_rows(log), _on_cpu(state)) for log, state in results])
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller, even KeyboardInterrupt
        try:
            outbox.send_error(getattr(e, "exogym_node", blocks(plan.num_nodes, processes)[p].start), e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # now: skip interpreter teardown, which could block on a process group mid-message
    dist.destroy_process_group()
    conn.close()


def _on_cpu(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if state is None else {k: v.detach().cpu() for k, v in state.items()}


def own_gpu(devices: list[torch.device], p: int) -> list[torch.device]:
    """On a machine with several GPUs, process p runs its CUDA nodes on GPU p (mod the count), as torchrun's
    processes take their LOCAL_RANK's; with one GPU every process shares it."""
    count = torch.cuda.device_count() if any(d.type == "cuda" for d in devices) else 0
    if count < 2:
        return devices
    return [torch.device("cuda", p % count) if d.type == "cuda" else d for d in devices]


def _run_block(plan: "RunPlan", p: int, processes: int, store: Any, run_key: str, start: float) -> list[Any]:
    """This process's nodes, with the exchange to the others' (`start`: the run's start on this machine's clock)."""
    exchange = Exchange(block_of(plan.num_nodes, processes), p, store, run_key)
    results = run_sim(plan, local=blocks(plan.num_nodes, processes)[p], exchange=exchange)
    rss = peak_rss_mb()
    for log, _ in results:
        log.comm["process_peak_rss_mb"] = rss  # each node's process: its peak, which the caller cannot see
    return results


def run_sim_launched(plan: "RunPlan", rank: int, world_size: int) -> list[Any]:
    """Under torchrun: this process simulates its block; every process returns the global model and every node's
    log (gathered at the end), as a one-process run would. Rank 0's loggers get its own nodes' rows as they train
    and the other processes' at the end, so the run folder's train.csv is the whole run's."""
    owns_group = not dist.is_initialized()
    timeout = process_group_timeout(None)  # as in run_sim_processes
    if owns_group:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise ValueError(f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, but RANK={rank}, WORLD_SIZE={world_size}")
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        run_key = f"exogym/sim/{_shared_run_id(store)}"
        results = _run_block(plan, rank, world_size, store, run_key, time.perf_counter())
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, [(log, state) for log, state in results])
    finally:
        if owns_group:
            dist.destroy_process_group()
    merged = [r for block in gathered for r in block]
    mine = blocks(plan.num_nodes, world_size)[rank]
    for r, (log, _) in enumerate(merged):  # the other blocks' rows reach this process's loggers at the end
        if r not in mine:
            plan.live.add_rows(r, log.rows)
    state = next(s for _, s in merged if s is not None)
    return [(merged[0][0], state)] + [(log, None) for log, _ in merged[1:]]


def _shared_run_id(store: Any) -> str:
    """One id per run for all processes of a torchrun job (several fits in one job keep their keys apart)."""
    if dist.get_rank() == 0:
        store.add("exogym/sim/runs", 1)
    dist.barrier()
    return str(store.add("exogym/sim/runs", 0))
