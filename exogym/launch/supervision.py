"""Processes on this machine that run part of a run, supervised from the caller: how they start, how the caller
reads what they report (log rows as they flush, then their results or their exception), how a failure in any of
them ends the others, and how the rows they completed reach the caller when the run stops early. The launcher of
local processes (exogym.launch.launchers) starts them here, whichever backend they run; what runs inside each is
exogym.launch.worker.

How processes start, and why not 'fork': a forked copy of the caller inherits its threads' half-held locks
(torch's OpenMP pool, loggers, a progress bar) and cannot use CUDA once the caller has; and fork is unsafe on
macOS. So they start clean: on Linux from a forkserver, a fresh single-threaded process that imports torch once and
forks a process per run in milliseconds; elsewhere (macOS, Windows) with 'spawn', a fresh interpreter each (a few
seconds: torch.optim alone imports torch._dynamo on first use). Either way the run must pickle: the model, the
datasets and the strategy are sent to each process, so they must be defined at module level of an importable
file, which is checked before any process starts (exogym.launch.pickling).
"""

from __future__ import annotations

import pickle
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

import torch.multiprocessing as torch_mp

from exogym.backends.errors import STUCK_EXIT_CODE, NodeProcessError, NodeTimeoutError, with_rank_note

__all__ = ["HOST", "Failure", "process_context", "supervise", "wind_down", "end_processes", "collect_last_rows",
           "keeps_type"]

HOST = "127.0.0.1"  # every process is on this machine: the rendezvous store listens on loopback only
_FINISH_GRACE_S = 60.0  # after the first process finishes, how long the others may take to finish too
_SETTLE_S = 1.0  # after the first failure, how long to collect the others' reports before ending them
# torch._dynamo: torch.optim imports it on first use, which costs a fresh process seconds.
_PRELOAD = ("torch", "torch._dynamo", "exogym.launch.worker", "exogym.backends.sim.run",
            "exogym.backends.torch.node_process", "exogym.fit.trainer")


@dataclass
class Failure:
    """What a process reports when it fails (or what the caller notes when one dies)."""

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
            if kind in _FED:
                _feed(live, kind, payload)
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


_FED = ("rows", "row", "peak")  # what a process sends for the run's live log


def _feed(live: Any, kind: str, payload: list[Any]) -> None:
    """A process's rows (as its nodes flush them), or its peak memory (as it fails), into the caller's live log."""
    if kind == "rows":
        live.add_rows(*payload)
    elif kind == "row":
        live.add_row(*payload)
    elif payload[1] is not None:
        live.note_peak_rss(*payload)


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
        return with_rank_note(first.exception, first.rank)
    if isinstance(first.exception, NodeTimeoutError):
        timeout = first.exception
        timeout.add_note(f"(reported by node {first.rank}, which waited for it; the run's node processes were ended)")
        return timeout
    if first.exception is not None and keeps_type(first.exception):
        return with_rank_note(first.exception, first.rank)
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


def keeps_type(error: BaseException) -> bool:
    """Whether an exception raised in a run's process reaches the caller as itself (with a note naming its node),
    rather than wrapped in a NodeProcessError: exogym's own errors (DiskFullError, CheckpointError, RunFolderError,
    ...), so that `except DiskFullError` works whatever the launcher. Other exceptions are wrapped, their
    traceback in the message and the exception as __cause__."""
    return type(error).__module__.startswith("exogym.") and not isinstance(error, NodeProcessError)


def _shorten(text: str, limit: int = 200) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def collect_last_rows(live: Any, procs: list[Any], conns: list[Connection], timeout_s: float = 3.0) -> None:
    """The run stopped early (a node failed, a signal): ask the processes still running to stop (SIGTERM, on which
    each sends the rows its nodes completed since their last flush, see exogym.launch.worker), and feed `live` the rows
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
            if kind in _FED:
                _feed(live, kind, payload)
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
