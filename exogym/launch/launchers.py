"""Launchers: who starts the processes of a run, and how the caller gets back what they return.

One launcher per way a run can be laid out, whatever its backend:

- `InProcess`: every node in the calling process (the sim, processes=1); nothing is started.
- `LocalProcesses`: P processes on this machine, started and supervised by the caller (the sim's processes=P, the
  torch backend's one process per node). It owns their process group's store, their pipes, the supervision, the
  rows collected from them when the run stops early, and their exit.
- `Torchrun`: this process is one of the processes torchrun started; it joins their process group (unless the
  script did), runs what it hosts, and gathers every node's log at the end.

A launcher describes what each process hosts (`Hosting`: its nodes, and extra roles such as a strategy's server in
the process holding node 0), and hands it to the backend (`ProcessBackend.run`), which runs inside one process.
Every launcher installs the run's one SIGTERM handler in the calling process (exogym.launch.signals) for as long
as the run runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import pickle
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from exogym.backends.errors import PeerLostError
from exogym.backends.peer_watch import PeerWatch
from exogym.backends.hosting import Hosting, Peers, ProcessBackend, block_of, limit_waits, setup_timeout
from exogym.launch.environment import Environment
from exogym.launch.pickling import check_picklable, to_bytes
from exogym.launch.shared_folder import check_shared_folder
from exogym.launch.row_relay import LockedLive, RelayReader, StoreRelay, store_timeout
from exogym.launch.signals import interrupt_on_sigterm
from exogym.launch.supervision import HOST, process_context, supervise, wind_down
from exogym.launch.worker import process_main, stamp_peak_rss, with_rows

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan, RunSinks

__all__ = ["Launcher", "InProcess", "LocalProcesses", "Torchrun", "layout"]


def layout(num_nodes: int, processes: int, *, roles: frozenset[str] = frozenset(),
           returns_model: bool = False) -> list[Hosting]:
    """What each of `processes` processes hosts: contiguous blocks of nodes (sizes differing by at most one), and
    the extra roles in the process holding node 0.

    Args:
        num_nodes: the run's nodes.
        processes: how many processes share them (1 to num_nodes).
        roles: participants other than nodes (e.g. exogym.backends.hosting.SERVER_ROLE), hosted beside node 0.
        returns_model: whether every process computes the global model itself.

    Returns:
        One Hosting per process, in process order.
    """
    owner = tuple(block_of(num_nodes, processes))
    return [Hosting(p, owner, roles=roles if p == owner[0] else frozenset(), returns_model=returns_model,
                    run_roles=roles)
            for p in range(processes)]


class Launcher(ABC):
    """Runs a plan's processes and returns every node's (log, state) in rank order.

    Attributes:
        backend: what runs inside each process.
        hosting: what each process hosts (index: process).
    """

    def __init__(self, backend: ProcessBackend, hosting: Sequence[Hosting]):
        self.backend, self.hosting = backend, list(hosting)

    @property
    def processes(self) -> int:
        """How many processes the run has."""
        return len(self.hosting)

    @property
    def is_main(self) -> bool:
        """Whether this process holds the run folders and the loggers."""
        return True

    @property
    def caller_is_extra(self) -> bool:
        """Whether the calling process runs beside the run's processes (a local launch's supervisor), so that its
        memory adds to theirs."""
        return isinstance(self, LocalProcesses)

    def node_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        """Where this launch runs each node, given where fit places them."""
        return list(devices)

    def live_nodes(self, num_nodes: int) -> Sequence[int]:
        """The nodes whose rows reach this process's live log (the run's loggers and progress bar)."""
        return range(num_nodes)

    def launch(self, plan: "RunPlan", sinks: "RunSinks") -> list[Any]:
        """Run the plan; SIGTERM in the calling process raises RunInterrupted meanwhile.

        Args:
            plan: the run, data only.
            sinks: this process's live log (fed with every node's rows), and on_stuck.

        Returns:
            Every node's (log, state) in rank order; the first entry's state is the global model.
        """
        with interrupt_on_sigterm():
            return self._launch(plan, sinks)

    @abstractmethod
    def _launch(self, plan: "RunPlan", sinks: "RunSinks") -> list[Any]:
        ...


class InProcess(Launcher):
    """Every node in the calling process (the sim backend with processes=1)."""

    def __init__(self, backend: ProcessBackend, num_nodes: int, *, roles: frozenset[str] = frozenset()):
        super().__init__(backend, layout(num_nodes, 1, roles=roles))

    def _launch(self, plan: "RunPlan", sinks: "RunSinks") -> list[Any]:
        return self.backend.run(plan, sinks, self.hosting[0], None)


class LocalProcesses(Launcher):
    """P processes on this machine, started from a forkserver (spawn off Linux) and supervised by the caller.

    Args:
        backend: what runs inside each process.
        num_nodes: the run's nodes.
        processes: how many processes (num_nodes when the backend runs one node per process).
        port: the rendezvous store's port (None: a free one the OS picks).
        roles: participants other than nodes, hosted beside node 0.
    """

    def __init__(self, backend: ProcessBackend, num_nodes: int, processes: int, *, port: int | None = None,
                 roles: frozenset[str] = frozenset()):
        super().__init__(backend, layout(num_nodes, processes, roles=roles))
        self.port = port

    def _labels(self) -> list[str]:
        if self.backend.one_node_per_process:
            return [f"node {h.nodes.start}" for h in self.hosting]
        return [f"process {h.process} (nodes {h.nodes.start}-{h.nodes.stop - 1})" for h in self.hosting]

    def _launch(self, plan: "RunPlan", sinks: "RunSinks") -> list[Any]:
        if self.backend.one_node_per_process:
            check_picklable(plan, f"backend={self.backend.name!r}", "each node's process")
        else:
            check_picklable(plan, f"processes={self.processes}", "each simulating process")
        timeout = self.backend.group_timeout(plan)
        # The store is the rendezvous point; listening on port 0 lets the OS pick a free port, with no race.
        store = dist.TCPStore(HOST, self.port or 0, is_master=True, wait_for_workers=False, timeout=timeout)
        # A simulating process computes with the caller's torch threads: a kernel's rounding may depend on the count
        # (a matmul's blocking), so the nodes give one process's bits. One node per process (torch.distributed)
        # shares the caller's threads instead: its bits are not the sim's anyway.
        threads = (max(1, torch.get_num_threads() // self.processes) if self.backend.one_node_per_process
                   else torch.get_num_threads())
        ctx = process_context()
        start = time.perf_counter()  # one machine, one clock: the nodes' wall times count from here, as in the sim
        procs: list[Any] = []
        conns: list[Any] = []
        plan_pipes: list[Any] = []
        finished = False
        try:
            for hosting in self.hosting:
                reader, writer = ctx.Pipe(duplex=False)
                plan_reader, plan_writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=process_main, name=f"exogym-{self.backend.name}-{hosting.process}",
                                   args=(self.backend, hosting, plan_reader, store.port, writer, start, threads,
                                         timeout))
                proc.start()
                writer.close()  # the process holds the only writer now: end of file on the reader means it is gone
                plan_reader.close()  # and the only reader of its plan: a process gone before reading it is EPIPE
                procs.append(proc)
                conns.append(reader)
                plan_pipes.append(plan_writer)
            for hosting, plan_writer in zip(self.hosting, plan_pipes):
                # Each process is sent its own nodes' data (the examples they read), not the whole dataset, as one
                # buffer: no file descriptor per tensor (exogym.launch.pickling); one process's buffer at a time.
                with contextlib.suppress(BrokenPipeError):  # the process is gone: supervise names how it ended
                    plan_writer.send_bytes(to_bytes(plan.for_nodes(hosting.nodes)))
                plan_writer.close()
            per_process = supervise(sinks.live, procs, conns, self._labels(), [h.nodes.start for h in self.hosting],
                                    passthrough=self.backend.passthrough)
            finished = True
            return [(with_rows(log, sinks.live), state) for (results,) in per_process for log, state in results]
        finally:
            for plan_writer in plan_pipes:
                plan_writer.close()
            wind_down(sinks.live, procs, conns, finished=finished)
            del store


def _connection_lost(error: BaseException) -> bool:
    """Whether an error says a connection to another process closed (it died, or its machine or link did)."""
    text = str(error).lower()
    return any(words in text for words in ("connection closed by peer", "connection reset by peer", "broken pipe",
                                           "connection refused"))


def _import_before_the_group() -> None:
    """Import torch.distributed.nn.functional before the process group exists (torch.optim's first step imports it
    through torch._dynamo otherwise). Its functions take `group=group.WORLD` as a default, evaluated at import: imported
    after init_process_group, they hold the default group for good, so destroy_process_group no longer destroys it and
    it is destroyed at interpreter exit instead. A gloo thread may then still be releasing its last collective's
    tensors, which needs the GIL of an interpreter being torn down: the process aborts ("terminate called without an
    active exception", SIGABRT), now and then, after a run that completed."""
    import torch.distributed.nn.functional  # noqa: F401


def _group_store(run: int, rank: int, world_size: int, timeout: timedelta) -> Any:
    """The job's store (torch's env:// rendezvous: torchrun's) under a prefix of the job's `run`-th fit, for its
    process group's rendezvous. torch.distributed names the default group "0" again once destroy_process_group has
    run, so without it a second fit in one job would meet the first group's addresses, still in the job's store, and
    connect to ports closed since: "Connection refused", or a wait that never ends (pytorch/pytorch#55967)."""
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    return dist.PrefixStore(f"exogym/group/{run}", store)


def _end_group(peer_lost: bool) -> None:
    """Destroy this process's process group; after a peer stopped responding, without running its destructor.

    A collective may then still wait on the stopped peer in a gloo thread, and the group's destructor joins that
    thread: this process would wait for the peer for the process group's timeout (node_timeout), and torchrun ends
    the stopped peer only once this process has exited. So the default group is kept alive for good (one reference
    that is never released: its threads end with the process) before torch.distributed lets go of it."""
    group = dist.group.WORLD
    if peer_lost and group is not None:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    dist.destroy_process_group()


_torchrun_runs = 0  # per process: the n-th run of a torchrun job is the n-th in each of its processes


class Torchrun(Launcher):
    """This process is one of the processes torchrun started (the job's environment says which).

    Under the sim each process hosts a block of nodes; under torch one node. Every process returns the global model
    and every node's log (gathered at the end), as a one-process run would. Under the sim the other processes' rows
    reach the main process's live log as they are flushed (exogym.launch.row_relay); under torch each process's
    loggers follow its own node.

    Args:
        backend: what runs inside this process.
        num_nodes: the run's nodes.
        environment: the job (rank, world size, local rank, store address).
        roles: participants other than nodes, hosted beside node 0.
    """

    def __init__(self, backend: ProcessBackend, num_nodes: int, environment: Environment, *,
                 roles: frozenset[str] = frozenset()):
        super().__init__(backend, layout(num_nodes, environment.world_size, roles=roles,
                                         returns_model=backend.one_node_per_process))
        self.environment = environment

    @property
    def is_main(self) -> bool:
        return self.environment.is_main

    def node_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        return self.environment.node_devices(devices)

    def live_nodes(self, num_nodes: int) -> Sequence[int]:
        # One node per process: each process's loggers follow its own node (rank 0 holds the run folder).
        return self.hosting[self.environment.rank].nodes if self.backend.one_node_per_process else range(num_nodes)

    def _launch(self, plan: "RunPlan", sinks: "RunSinks") -> list[Any]:
        global _torchrun_runs
        _torchrun_runs += 1
        env, hosting = self.environment, self.hosting[self.environment.rank]
        timeout = self.backend.group_timeout(plan)
        owns_group = not dist.is_initialized()  # a script may have set up torch.distributed itself; then it keeps it
        if owns_group:
            _import_before_the_group()
            # Each process has a GPU of its own (LOCAL_RANK): its own nodes' devices choose the group's backend.
            group_backend = self.backend.group_backend([plan.devices[r] for r in hosting.nodes])
            setup = setup_timeout(timeout, group_backend)  # the other ranks may arrive seconds later
            group_store = _group_store(_torchrun_runs, env.rank, env.world_size, setup)
            dist.init_process_group(group_backend, store=group_store, rank=env.rank, world_size=env.world_size,
                                    timeout=setup)
            limit_waits(dist.group.WORLD, group_store, setup, timeout)
        elif dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                             f"{dist.get_world_size()}, but RANK={env.rank}, WORLD_SIZE={env.world_size}; call "
                             "fit() in a process torchrun started, before or without your own init_process_group")
        try:
            store = None
            if env.main_address is not None and env.main_port is not None:
                store = dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=timeout)
            run_key = f"exogym/{self.backend.name}/{_torchrun_runs}"
            if plan.checkpoints is not None and store is not None and env.world_size > 1:
                check_shared_folder(store, f"{run_key}/shared", env.rank, env.world_size, plan.checkpoints.root)
            peers = Peers(store, env.main_address or HOST, env.main_port or 0, run_key, time.perf_counter(), timeout)
            own_sinks, reader = self._relay(sinks, store, f"{run_key}/rows", timeout)
            # Every rank beats in the store, so that a rank whose connection closed is named (below).
            watch = PeerWatch(store, f"{run_key}/ranks", env.rank, hosting.owner, None) if store is not None else None
            try:
                try:
                    results = self.backend.run(plan, own_sinks, hosting, peers)
                except BaseException as e:
                    raise self._peer_error(e, store, run_key, watch) from None
                if watch is not None:
                    watch.finished()
                stamp_peak_rss(results)
                gathered: list[Any] = [None] * env.world_size
                dist.all_gather_object(gathered, [log for log, _ in results])
            finally:
                if watch is not None:
                    watch.close()
                if reader is not None:  # every row the others posted, also when the run stopped part-way
                    reader.stop(store)
            state = next((s for _, s in results if s is not None), None)
            if not hosting.returns_model:  # the process holding node 0 hands the global model on
                box = [state]
                dist.broadcast_object_list(box, src=hosting.owner[0])
                state = box[0]
        except BaseException as e:
            lost = isinstance(e, PeerLostError) or isinstance(e.__cause__, PeerLostError)
            raise
        else:
            lost = False
        finally:
            if owns_group:
                _end_group(lost)
        logs = [log for block in gathered for log in block]
        if reader is None:  # one node per process: each process's loggers follow its own node
            for log in logs:
                if log.rank not in hosting.nodes:
                    sinks.live.add_rows(log.rank, log.rows)
        return [(logs[0], state)] + [(log, None) for log in logs[1:]]

    def _peer_error(self, error: BaseException, store: Any, key: str, watch: PeerWatch | None) -> BaseException:
        """What this process raises when its run stopped on `error`. A process posts its own error to the job's
        store before it exits. A process whose connection to another closed (gloo's "Connection closed by peer",
        on either backend) names the rank whose beat stopped (PeerLostError), not its own node; a process that
        lost a peer raises the peer's posted error instead (its type kept, with a note naming the peer's rank
        and nodes), when there is one."""
        if store is None:
            return error
        interrupted = isinstance(error, KeyboardInterrupt)  # torchrun stops every rank once one of them died
        if not isinstance(error, PeerLostError) and watch is not None and (_connection_lost(error) or interrupted):
            with contextlib.suppress(Exception):
                try:
                    gone = watch.silent()
                except KeyboardInterrupt as e:  # torchrun's SIGTERM to every rank, as one died: look again
                    error, interrupted = e, True
                    gone = watch.silent()
                if interrupted:  # a rank stopped by the same signal posted it: a silent one that did not, died
                    gone = [p for p in gone if not store.check([f"{key}/failed/{p}"])]
                if gone:
                    how = (f"its beat stopped, and then this rank was stopped ({error})" if interrupted else None)
                    error = watch.lost(gone[0], error, how)
        if interrupted and not isinstance(error, PeerLostError):
            # torchrun stops every rank once one exited with an error, which it posted first: that error is how the
            # run ended (a stop noticed before the peer's failure reached this rank would say "interrupted")
            theirs = self._posted_failure(store, key, error)
            if theirs is not None:
                return theirs
        if not isinstance(error, PeerLostError):
            with contextlib.suppress(Exception):
                store.set(f"{key}/failed/{self.environment.rank}", pickle.dumps(error))
            return error
        with contextlib.suppress(Exception):
            name = f"{key}/failed/{error.process}"
            if store.check([name]):
                theirs = pickle.loads(store.get(name))
                if isinstance(theirs, BaseException):
                    theirs.add_note(f"(raised by rank {error.process}, which hosts node(s) {list(error.nodes)}; "
                                    f"rank {self.environment.rank} noticed it went away)")
                    theirs.__cause__ = error
                    return theirs
        return error

    def _posted_failure(self, store: Any, key: str, error: BaseException) -> BaseException | None:
        """The error another rank posted before it exited (not an interrupt of its own), with a note that this rank
        was then stopped by `error`; None when none posted one."""
        for rank in range(self.environment.world_size):
            name = f"{key}/failed/{rank}"
            with contextlib.suppress(Exception):
                if rank != self.environment.rank and store.check([name]):
                    theirs = pickle.loads(store.get(name))
                    if isinstance(theirs, BaseException) and not isinstance(theirs, KeyboardInterrupt):
                        theirs.add_note(f"(raised by rank {rank}; then torchrun stopped rank "
                                        f"{self.environment.rank}: {error!r})")
                        return theirs
        return None

    def _relay(self, sinks: "RunSinks", store: Any, key: str, timeout: Any) -> tuple["RunSinks", RelayReader | None]:
        """Under the sim every process's rows reach the main process's loggers as they are flushed (through the
        job's store, exogym.launch.row_relay): this process's sinks, and the main process's reader of the others'
        rows."""
        if self.backend.one_node_per_process or store is None or self.processes == 1:
            return sinks, None
        env = self.environment
        if not env.is_main:
            return dataclasses.replace(sinks, live=StoreRelay(sinks.live, store, f"{key}/{env.rank}")), None
        lock = threading.Lock()
        connect = lambda: dist.TCPStore(env.main_address, env.main_port, is_master=False,  # noqa: E731
                                        timeout=store_timeout(timeout))
        reader = RelayReader(sinks.live, connect, [f"{key}/{p}" for p in range(1, self.processes)], lock).start()
        return dataclasses.replace(sinks, live=LockedLive(sinks.live, lock)), reader
