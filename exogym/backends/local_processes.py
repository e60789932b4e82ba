"""Processes on this machine that run part of a run, supervised from the caller: how they start, how they report
back (log rows as they flush, then their results or their exception), and how a failure in any of them ends the
others. Both the torch backend's local spawn (one process per node) and the sim's processes=P (one process per
block of nodes) start theirs here.

How processes start, and why not 'fork': a forked copy of the caller inherits its threads' half-held locks
(torch's OpenMP pool, loggers, a progress bar) and cannot use CUDA once the caller has; and fork is unsafe on
macOS. So they start clean: on Linux from a forkserver, a fresh single-threaded process that imports torch once and
forks a process per run in milliseconds; elsewhere (macOS, Windows) with 'spawn', a fresh interpreter each (a few
seconds: torch.optim alone imports torch._dynamo on first use). Either way the run must pickle: the model, the
datasets and the strategy are sent to each process, so they must be defined at module level of an importable
file, which is checked before any process starts.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from exogym.backends.errors import NodeProcessError, NodeTimeoutError
from exogym.backends.sim.watchdog import STUCK_EXIT_CODE

__all__ = ["HOST", "Failure", "process_context", "supervise", "wind_down", "end_processes", "collect_last_rows",
           "stop_on_sigterm", "Outbox", "ForwardingLive", "check_picklable", "without_rows", "with_rows"]

HOST = "127.0.0.1"  # every process is on this machine: the rendezvous store listens on loopback only
_FINISH_GRACE_S = 60.0  # after the first process finishes, how long the others may take to finish too
_SETTLE_S = 1.0  # after the first failure, how long to collect the others' reports before ending them
# torch._dynamo: torch.optim imports it on first use, which costs a fresh process seconds.
_PRELOAD = ("torch", "torch._dynamo", "exogym.backends.torch.spawn", "exogym.backends.sim.processes",
            "exogym.trainer")


@dataclass
class Failure:
    rank: int
    stamp: float  # time.monotonic() in the node's process (one clock for the whole machine)
    summary: str  # "ValueError: ..." or how the process ended
    traceback: str = ""
    exception: BaseException | None = None
    from_peer: bool = False  # a torch.distributed error: likely the consequence of another node's failure


def process_context() -> Any:
    """forkserver on Linux, spawn elsewhere (see the module docstring)."""
    if sys.platform != "linux":
        return torch_mp.get_context("spawn")
    ctx = torch_mp.get_context("forkserver")
    # Modules the server imports once and every node process inherits; the user's own preloads are kept.
    current = getattr(forkserver._forkserver, "_preload_modules", None) or ["__main__"]
    ctx.set_forkserver_preload(list(dict.fromkeys([*current, *_PRELOAD])))
    return ctx


def supervise(live: Any, procs: list[Any], conns: list[Connection], labels: Sequence[str],
              first_nodes: Sequence[int] | None = None, passthrough: tuple[type, ...] = ()) -> list[tuple[Any, ...]]:
    """Feed `live` with the processes' log rows until each has sent its result; return the results in process
    order, or raise the root failure (NodeProcessError, or the NodeTimeoutError a process reported) once any
    process failed or died. labels[i] names process i in messages ("node 3", "process 1 (nodes 4-7)");
    first_nodes[i] is the node a process that died silently is reported as (default: i). A root failure that is
    one of `passthrough` (the sim's CollectiveError) is raised as itself, as one process would raise it."""
    k = len(procs)
    first_nodes = list(range(k)) if first_nodes is None else list(first_nodes)
    results: dict[int, tuple[Any, Any]] = {}
    failures: list[Failure] = []
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
                    failures.append(_died(first_nodes[rank], labels[rank], procs[rank]))
                continue
            if kind == "rows":
                live.add_rows(*payload)
            elif kind == "row":
                live.add_row(*payload)
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
        raise _failure_error(failures, finished=sorted(results), passthrough=passthrough)
    if len(results) < k:
        missing, done = sorted(set(range(k)) - set(results)), sorted(results)
        raise NodeProcessError(
            f"{', '.join(labels[i] for i in missing)} did not finish within {_FINISH_GRACE_S:.0f} s after "
            f"{', '.join(labels[i] for i in done)} had finished; they are probably waiting in a collective the "
            "finished nodes never called (every node must call the same collectives in the same order). The run "
            "was stopped", first_nodes[missing[0]])
    return [results[r] for r in range(k)]


def _died(rank: int, label: str, proc: Any) -> Failure:
    proc.join(timeout=5)
    code = proc.exitcode
    if code == STUCK_EXIT_CODE:
        how = (f"exited with code {code}: its watchdog found a node stuck in native code past node_timeout and ended "
               "the process (its message is in the output above)")
    elif code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        how = (f"was killed by signal {name}: out of memory, or a crash in native code (see its output above; with "
               "gloo, SIGABRT often means the nodes called different collectives)")
    else:
        how = (f"exited (code {code}) without reporting a result or an exception: os._exit() or a failure while "
               "starting (see its output above; a script must call fit() under `if __name__ == \"__main__\":`)")
    return Failure(rank, time.monotonic(), f"{label}'s process {how}")


def _failure_error(failures: list[Failure], finished: list[int], passthrough: tuple[type, ...] = ()) -> Exception:
    """The error for the caller: the root cause first (the earliest exception that is not a torch.distributed error
    caused by a peer going away, else a process that died silently, else the earliest), the rest in one line each.
    A collective that timed out is a NodeTimeoutError naming the node(s) that never reached it, as on the sim."""
    raised = sorted((f for f in failures if f.traceback), key=lambda f: f.stamp)
    died = [f for f in failures if not f.traceback]
    first = next((f for f in raised if not f.from_peer), died[0] if died else raised[0])
    if passthrough and isinstance(first.exception, passthrough):
        first.exception.add_note(f"(raised in the process of node {first.rank}; the run's other processes were ended)")
        return first.exception
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


def collect_last_rows(live: Any, procs: list[Any], conns: list[Connection], timeout_s: float = 3.0) -> None:
    """The run stopped early (a node failed, a signal): ask the processes still running to stop (SIGTERM, on which
    each sends the rows its nodes completed since their last flush, see stop_on_sigterm), and feed `live` the rows
    they send until every pipe is closed or timeout_s has passed. A process blocked inside a native call (a gloo
    collective) cannot answer: it is killed then, and its unsent rows are lost."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    open_ = [c for c in conns if not c.closed]
    while open_ and time.monotonic() < deadline:
        for conn in wait(open_, max(0.0, deadline - time.monotonic())):
            try:
                kind, *payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                open_.remove(conn)
                continue
            if kind == "rows":
                live.add_rows(*payload)
            elif kind == "row":
                live.add_row(*payload)
    for p in procs:
        if p.is_alive():
            p.kill()


def wind_down(live: Any, procs: list[Any], conns: list[Connection], *, finished: bool) -> None:
    """After supervise: a run that finished gives its processes 10 s to exit on their own; one that stopped early
    first collects the rows they completed since their last flush (collect_last_rows). Then every process is
    reaped and every pipe closed."""
    if not finished:
        collect_last_rows(live, procs, conns)
    end_processes(procs, grace_s=10.0 if finished else 0.0)
    for c in conns:
        c.close()


def stop_on_sigterm() -> None:
    """In a run's process: SIGTERM (the caller ending it, or a scheduler) raises KeyboardInterrupt, so that the
    process reports what its nodes completed before it exits, as on Ctrl-C."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, stop)


def end_processes(procs: list[Any], grace_s: float) -> None:
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


class Outbox:
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


def check_picklable(plan: Any, what: str, where: str) -> None:
    """`what` ("backend='torch'") sends the plan to `where` ("each node's process"): it must pickle, and name
    nothing of an interactive session."""
    fix = ("define the model, the dataset and the strategy (and any function they hold) at the top level of an "
           "importable .py file, not inside a function or as a lambda; or run every node in this process "
           "(backend='sim' with processes=1), which pickles nothing")
    pickler = _CheckingPickler()
    try:
        pickler.dump(plan)
    except Exception as e:
        raise TypeError(f"{what} sends the model, the datasets and the strategy to {where} by "
                        f"pickling them, and that failed: {type(e).__name__}: {e}. To fix it, {fix}") from e
    if pickler.from_interactive_main:
        names = sorted(set(pickler.from_interactive_main))
        raise TypeError(f"{what} starts a fresh process for {where.removeprefix('each ')}, which cannot import "
                        f"{names}: they are defined in an interactive session (a notebook or `python -c`). To fix "
                        f"it, {fix}")
