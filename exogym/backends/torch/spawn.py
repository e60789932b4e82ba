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
import io
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from exogym.backends.torch.node_process import pick_backend, process_group_timeout, run_node
from exogym.backends.errors import NodeProcessError, NodeTimeoutError

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan
    from exogym.runs.record import NodeLog

__all__ = ["run_spawned", "NodeProcessError"]

_FINISH_GRACE_S = 60.0  # after the first node finishes, how long the others may take to finish too
_SETTLE_S = 1.0  # after the first failure, how long to collect the others' reports before ending them
# torch._dynamo: torch.optim imports it on first use, which costs a fresh process seconds.
_PRELOAD = ("torch", "torch._dynamo", "exogym.backends.torch.spawn", "exogym.trainer")
_HOST = "127.0.0.1"  # every node is on this machine: the rendezvous store listens on loopback only


@dataclass
class _Failure:
    rank: int
    stamp: float  # time.monotonic() in the node's process (one clock for the whole machine)
    summary: str  # "ValueError: ..." or how the process ended
    traceback: str = ""
    exception: BaseException | None = None
    from_peer: bool = False  # a torch.distributed error: likely the consequence of another node's failure


def run_spawned(plan: "RunPlan") -> list[tuple["NodeLog", dict[str, torch.Tensor] | None]]:
    """Start one process per node, feed the plan's live log from their rows, return their results in rank order."""
    k = plan.num_nodes
    node_plan = dataclasses.replace(plan, live=None)  # each process forwards its rows here instead
    _check_picklable(node_plan)
    backend = pick_backend(plan.devices)
    # The store is the rendezvous point; listening on port 0 lets the OS pick a free port, with no race.
    timeout = process_group_timeout(plan.node_timeout)
    store = dist.TCPStore(_HOST, plan.port or 0, is_master=True, wait_for_workers=False, timeout=timeout)
    threads = max(1, torch.get_num_threads() // k)  # the nodes share the caller's CPU threads
    ctx = _context()
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
        results = _supervise(plan, procs, conns)
        finished = True
        return results
    finally:
        _end(procs, grace_s=10.0 if finished else 0.0)
        for c in conns:
            c.close()
        del store


def _context() -> Any:
    """forkserver on Linux, spawn elsewhere (see the module docstring)."""
    if sys.platform != "linux":
        return torch_mp.get_context("spawn")
    ctx = torch_mp.get_context("forkserver")
    # Modules the server imports once and every node process inherits; the user's own preloads are kept.
    current = getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"]
    ctx.set_forkserver_preload(list(dict.fromkeys([*current, *_PRELOAD])))
    return ctx


def _supervise(plan: "RunPlan", procs: list[Any], conns: list[Connection]) -> list[tuple[Any, Any]]:
    k = len(procs)
    results: dict[int, tuple[Any, Any]] = {}
    failures: list[_Failure] = []
    open_ = set(range(k))
    deadline: float | None = None
    while open_ and len(results) < k:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait([conns[r] for r in sorted(open_)], timeout)
        if not ready:
            break  # the grace period after the first finished node, or the settling after a failure, is over
        for conn in ready:
            rank = conns.index(conn)
            try:
                kind, *payload = pickle.loads(conn.recv_bytes())
            except EOFError:  # the process is gone
                open_.discard(rank)
                if rank not in results and not any(f.rank == rank for f in failures):
                    failures.append(_died(rank, procs[rank]))
                continue
            if kind == "rows":
                plan.live.add_rows(*payload)
            elif kind == "row":
                plan.live.add_row(*payload)
            elif kind == "done":
                results[rank] = tuple(payload)
            else:
                failures.append(payload[0])
        if failures:
            settle = time.monotonic() + _SETTLE_S
            deadline = settle if deadline is None else min(deadline, settle)
        elif results and deadline is None:
            deadline = time.monotonic() + _FINISH_GRACE_S
    if failures:
        raise _failure_error(failures, finished=sorted(results))
    if len(results) < k:
        missing, done = sorted(set(range(k)) - set(results)), sorted(results)
        raise NodeProcessError(
            f"node(s) {missing} did not finish within {_FINISH_GRACE_S:.0f} s after node(s) {done} had finished; "
            "they are probably waiting in a collective the finished nodes never called (every node must call the "
            "same collectives in the same order). The run was stopped", missing[0])
    return [results[r] for r in range(k)]


def _died(rank: int, proc: Any) -> _Failure:
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        how = (f"was killed by signal {name}: out of memory, or a crash in native code (see its output above; with "
               "gloo, SIGABRT often means the nodes called different collectives)")
    else:
        how = (f"exited (code {code}) without reporting a result or an exception: os._exit() or a failure while "
               "starting (see its output above; a script must call fit() under `if __name__ == \"__main__\":`)")
    return _Failure(rank, time.monotonic(), f"node {rank}'s process {how}")


def _failure_error(failures: list[_Failure], finished: list[int]) -> Exception:
    """The error for the caller: the root cause first (the earliest exception that is not a torch.distributed error
    caused by a peer going away, else a process that died silently, else the earliest), the rest in one line each.
    A collective that timed out is a NodeTimeoutError naming the node(s) that never reached it, as on the sim."""
    raised = sorted((f for f in failures if f.traceback), key=lambda f: f.stamp)
    died = [f for f in failures if not f.traceback]
    first = next((f for f in raised if not f.from_peer), died[0] if died else raised[0])
    if isinstance(first.exception, NodeTimeoutError):
        timeout = first.exception
        timeout.add_note(f"(reported by node {first.rank}, which waited for it; the run's node processes were ended)")
        return timeout
    lines = [f"node {first.rank} failed, so the run was stopped: {first.summary}"]
    if first.traceback:
        lines += ["", f"node {first.rank}'s traceback (in its own process):", first.traceback.rstrip()]
    others = [f for f in raised + died if f is not first]
    if others:
        lines += ["", "then:"] + [f"  node {f.rank}: {_shorten(f.summary)}" for f in others]
    if "timed out" in first.summary.lower():
        lines += ["", "a collective waited longer than the process-group timeout "
                      "(fit's node_timeout): the nodes were probably waiting in "
                      "different collectives (every node must call the same collectives in the same order; the sim "
                      "backend names the mismatch at once)"]
    if finished and first.from_peer:
        lines += ["", f"node(s) {finished} had finished: the others were probably still waiting in a collective the "
                      "finished nodes never called (every node must call the same collectives in the same order)"]
    error = NodeProcessError("\n".join(lines), first.rank)
    error.__cause__ = first.exception
    return error


def _shorten(text: str, limit: int = 200) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _end(procs: list[Any], grace_s: float) -> None:
    """Give the node processes grace_s seconds to exit on their own, then stop those still running (they may be
    blocked in a collective), and reap them all."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


# ---- inside a node's process ------------------------------------------------------------------------------------

class _Outbox:
    def __init__(self, conn: Connection):
        self.conn = conn

    def send(self, *message: Any) -> None:
        # Plain pickle, tensors by value: the process may exit right after, so nothing may refer back to it.
        self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_error(self, rank: int, e: BaseException) -> None:
        text = "".join(traceback.format_exception(e))
        summary = f"{type(e).__name__}: {e}" + "".join(f" {n}" for n in getattr(e, "__notes__", []))
        try:
            sendable = pickle.loads(pickle.dumps(e))
        except Exception:  # an exception that does not survive pickling: its text still goes back
            sendable = None
        from_peer = isinstance(e, getattr(dist, "DistError", ())) or "gloo" in str(e).lower()
        self.send("error", _Failure(rank, time.monotonic(), summary, text, sendable, from_peer))


class _ForwardingLive:
    """Stands in for the run's LiveLog in a node's process: rows go to the caller, which feeds the real one."""

    def __init__(self, outbox: _Outbox):
        self.outbox = outbox

    def add_rows(self, rank: int, rows: list[dict[str, float]]) -> None:
        self.outbox.send("rows", rank, rows)

    def add_row(self, table: str, row: dict[str, float]) -> None:
        self.outbox.send("row", table, row)


def _node_main(rank: int, plan: "RunPlan", port: int, backend: str, conn: Connection, start: float,
               threads: int, timeout: timedelta) -> None:
    """A node process: join the process group, run the node, report; on any exception report it and exit."""
    outbox = _Outbox(conn)
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=plan.num_nodes, timeout=timeout)
        plan.live = _ForwardingLive(outbox)
        heartbeat_store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=30))
        _, _, log, state = run_node(plan, rank, backend, start, timeout, heartbeat_store)
        outbox.send("done", log, None if state is None else {k: v.detach().cpu() for k, v in state.items()})
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller, even KeyboardInterrupt
        try:
            outbox.send_error(rank, e)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # now: skip interpreter teardown, which could block on a process group mid-collective
    dist.destroy_process_group()
    conn.close()


# ---- before any process starts ----------------------------------------------------------------------------------

class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return len(b)


class _CheckingPickler(pickle.Pickler):
    """Pickles into nothing, noting classes and functions of an interactive __main__ (a notebook, `python -c`),
    which pickle by name but which a node process cannot import."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=pickle.HIGHEST_PROTOCOL)
        self.from_interactive_main: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            if getattr(obj, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
                self.from_interactive_main.append(obj.__qualname__)
        return NotImplemented


def _check_picklable(plan: "RunPlan") -> None:
    fix = ("define the model, the dataset and the strategy (and any function they hold) at the top level of an "
           "importable .py file, not inside a function or as a lambda; or use backend='sim', which runs every node "
           "in this process and pickles nothing")
    pickler = _CheckingPickler()
    try:
        pickler.dump(plan)
    except Exception as e:
        raise TypeError(f"backend='torch' sends the model, the datasets and the strategy to each node's process by "
                        f"pickling them, and that failed: {type(e).__name__}: {e}. To fix it, {fix}") from e
    if pickler.from_interactive_main:
        names = sorted(set(pickler.from_interactive_main))
        raise TypeError(f"backend='torch' starts a fresh process per node, which cannot import {names}: they are "
                        f"defined in an interactive session (a notebook or `python -c`). To fix it, {fix}")
