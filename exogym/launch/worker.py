"""Inside a process a launcher started: the one body every such process runs, whichever backend, and the pipe
back to the caller (log rows as they flush, then the process's results or its exception).

process_main joins the run's process group, runs what the process hosts on its backend (ProcessBackend.run), and
reports. SIGTERM raises RunInterrupted (exogym.launch.signals), so a process the caller ends reports the rows its
nodes completed before it exits, as on Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from exogym.backends.hosting import Hosting, Peers, ProcessBackend, limit_waits, setup_timeout
from exogym.engine.plan import RunSinks
from exogym.launch.pickling import from_bytes
from exogym.launch.signals import raise_on_sigterm
from exogym.launch.supervision import HOST, Failure

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan

__all__ = ["Outbox", "ForwardingLive", "process_main", "without_rows", "with_rows", "own_gpu", "stamp_peak_rss",
           "peak_rss_mb", "on_cpu"]


class Outbox:
    """A process's end of its pipe to the caller; messages go whole, one at a time."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()  # the sim's watchdog thread may report a stuck node while rows go out

    def send(self, *message: Any) -> None:
        # Plain pickle, tensors by value: the process may exit right after, so nothing may refer back to it.
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def send_error(self, rank: int, e: BaseException) -> None:
        text = "".join(traceback.format_exception(e))
        summary = f"{type(e).__name__}: {e}" + "".join(f" {n}" for n in getattr(e, "__notes__", []))
        try:
            sendable = pickle.loads(pickle.dumps(e))
        except Exception:  # an exception that does not survive pickling: its text still goes back
            sendable = None
        from_peer = isinstance(e, getattr(dist, "DistError", ())) or "gloo" in str(e).lower()
        self.send("error", Failure(rank, time.monotonic(), summary, text, sendable, from_peer))


def without_rows(log: Any) -> Any:
    """A node's log for its "done" message: its rows reached the caller as they were flushed (ForwardingLive), so
    they are not sent (nor held by the caller) twice; the caller puts them back from its live log (with_rows)."""
    return dataclasses.replace(log, rows=[])


def with_rows(log: Any, live: Any) -> Any:
    """The log of a node whose rows came through `live` (the run's LiveLog), whole again."""
    log.rows = live.rows_of(log.rank)
    return log


class ForwardingLive:
    """Stands in for the run's LiveLog in a node's process: rows go to the caller, which feeds the real one."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None:
        self.outbox.send("rows", rank, rows)

    def add_row(self, table: str, row: dict[str, float]) -> None:
        self.outbox.send("row", table, row)




def own_gpu(devices: list[torch.device], p: int) -> list[torch.device]:
    """On a machine with several GPUs, process p runs its CUDA nodes on GPU p (mod the count), as torchrun's
    processes take their LOCAL_RANK's; with one GPU every process shares it."""
    count = torch.cuda.device_count() if any(d.type == "cuda" for d in devices) else 0
    if count < 2:
        return devices
    return [torch.device("cuda", p % count) if d.type == "cuda" else d for d in devices]


def on_cpu(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    """A state dict as CPU tensors, to send to another process (None stays None)."""
    return None if state is None else {k: v.detach().cpu() for k, v in state.items()}


def peak_rss_mb() -> float | None:
    """This process's peak resident memory in MB (None where the platform does not say: Windows)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux


def stamp_peak_rss(results: list[Any]) -> None:
    """Each node's log records its process's peak resident memory, which the caller cannot see."""
    rss_mb = peak_rss_mb()
    if rss_mb is None:
        return
    for log, _ in results:
        log.comm["process_peak_rss_mb"] = rss_mb


def exit_with_caller(poll_s: float = 1.0) -> None:
    """This process ends when the caller that started it is gone (SIGKILLed: nothing could stop its processes),
    rather than training on alone and writing checkpoints beside a resumed run. Its parent (the caller, or the
    forkserver, which exits with the caller) changing means the caller is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exogym-caller-watch", daemon=True).start()


def process_main(backend: ProcessBackend, hosting: Hosting, plan_conn: Connection, port: int, conn: Connection,
                 start: float, threads: int, timeout: timedelta) -> None:
    """A process of a local launch: join the process group, run what it hosts, report; on any exception report it
    and exit.

    Args:
        backend: what runs inside the process.
        hosting: what this process hosts.
        plan_conn: where the caller writes the run for this process's nodes, once, as one buffer
            (exogym.launch.pickling; without its sinks: this process makes its own, which forward to the caller).
        port: the caller's store.
        conn: the pipe to the caller (this process holds its only writer).
        start: the run's start on this machine's clock.
        threads: torch's threads in this process.
        timeout: the process group's timeout.
    """
    outbox = Outbox(conn)
    exit_with_caller()
    try:
        raise_on_sigterm()
        torch.set_num_threads(threads)
        plan: "RunPlan" = from_bytes(plan_conn.recv_bytes())  # the buffer is dropped once read
        plan_conn.close()
        group_backend = backend.group_backend(plan.devices)
        setup = setup_timeout(timeout, group_backend)  # the other processes may arrive seconds later
        store = dist.TCPStore(HOST, port, is_master=False, timeout=setup)
        dist.init_process_group(group_backend, store=store, rank=hosting.process, world_size=hosting.processes,
                                timeout=setup)
        limit_waits(dist.group.WORLD, store, setup, timeout)
        # A node stuck in native code is reported before the watchdog ends this process.
        sinks = RunSinks(ForwardingLive(outbox), on_stuck=lambda error: outbox.send_error(error.rank, error))
        if backend.processes_take_gpus:
            plan = dataclasses.replace(plan, devices=own_gpu(plan.devices, hosting.process))
        peers = Peers(store, HOST, port, f"exogym/{backend.name}", start, timeout)
        results = backend.run(plan, sinks, hosting, peers)
        stamp_peak_rss(results)
        outbox.send("done", [(without_rows(log), on_cpu(state)) for log, state in results])
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller, even KeyboardInterrupt
        try:
            with contextlib.suppress(Exception):  # the failed run's record holds this process's memory too
                outbox.send("peak", hosting.nodes.start, peak_rss_mb())
            outbox.send_error(getattr(e, "exogym_node", hosting.nodes.start), e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # now: skip interpreter teardown, which could block on a process group mid-message
    dist.destroy_process_group()
    conn.close()
