"""What a launcher hands a backend: the part of the run one process hosts, and how it reaches the other processes.

A backend (`exogym.backends.sim`, `exogym.backends.torch`) is reduced to what runs inside one process: given the
plan, the process's sinks, its `Hosting` and its `Peers`, it runs what that process hosts and returns its nodes'
(log, state) pairs. Starting processes, their process group, pipes, supervision, signals and the exit belong to the
launcher (`exogym.launch`), which is the one layer that knows how many processes there are and who started them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from exogym.backends.peer_watch import STARTUP_S

from exogym.engine.execution import FusedFallbackWarning

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan, RunSinks

__all__ = ["Hosting", "Peers", "ProcessBackend", "blocks", "block_of", "process_group_timeout",
           "PROCESS_GROUP_TIMEOUT", "SERVER_ROLE", "sequential_execution", "setup_timeout", "limit_waits"]

# The role of a participant that is not a node: a strategy's server (global state, and code reacting to each
# arriving message). It runs in the process that holds node 0; no launcher needs to know more than that.
SERVER_ROLE = "server"  # (the server's rank in messages is exogym.cluster.network.SERVER)

# How long a torch.distributed wait may last before it gives up. fit's node_timeout where the backend uses it (the
# torch backend: a node that never reaches a collective, named by exogym.backends.torch.heartbeat); None asks for no
# limit, and torch.distributed needs a finite one, so that is PROCESS_GROUP_TIMEOUT (a week).
PROCESS_GROUP_TIMEOUT = timedelta(days=7)


def process_group_timeout(node_timeout: float | None) -> timedelta:
    """The process group's timeout for a node timeout.

    Args:
        node_timeout: seconds (fit's node_timeout), or None for no limit.

    Returns:
        The timeout, PROCESS_GROUP_TIMEOUT when node_timeout is None.
    """
    return PROCESS_GROUP_TIMEOUT if node_timeout is None else timedelta(seconds=node_timeout)


# Setting a gloo process group up (its rendezvous in the store, then a connection between every pair of processes)
# waits for every process to arrive, and they arrive seconds apart: each imports torch and unpickles or builds its
# part of the run first, slower on a loaded machine. node_timeout bounds a node's wait at a collective while
# training, not that start, so the setup waits at least STARTUP_S (as a peer that never beat is given), and the
# group's waits are then cut to the process group's timeout (limit_waits). nccl connects at the first collective,
# within node_timeout as before; a torch without ProcessGroup.set_timeout keeps the group's timeout for the setup.
_RETIMABLE = hasattr(dist.ProcessGroup, "set_timeout")


def setup_timeout(timeout: timedelta, group_backend: str) -> timedelta:
    """How long setting up a process group (and connecting to its store) may wait for the other processes.

    Args:
        timeout: the process group's timeout (process_group_timeout).
        group_backend: the group's torch.distributed backend ("gloo", "nccl").

    Returns:
        `timeout`; for gloo at least STARTUP_S seconds, where the group's timeout can be set once it is up.
    """
    return max(timeout, timedelta(seconds=STARTUP_S)) if _RETIMABLE and group_backend == "gloo" else timeout


def limit_waits(group: Any, store: Any, setup: timedelta, timeout: timedelta) -> None:
    """Once a group set up with setup_timeout is up: its collectives and its store client's waits give up after
    `timeout`, the process group's timeout.

    Args:
        group: the torch.distributed ProcessGroup.
        store: the store client it set up with.
        setup: the timeout it was set up with (setup_timeout).
        timeout: the process group's timeout.
    """
    if setup != timeout:
        group.set_timeout(timeout)
        store.set_timeout(timeout)


def blocks(num_nodes: int, processes: int) -> list[range]:
    """Contiguous blocks of nodes, one per process, sizes differing by at most one (the first ones larger).

    Args:
        num_nodes: the run's nodes.
        processes: how many processes share them (at most num_nodes).

    Returns:
        Process p's nodes at index p.
    """
    size, extra = divmod(num_nodes, processes)
    out, start = [], 0
    for p in range(processes):
        n = size + (p < extra)
        out.append(range(start, start + n))
        start += n
    return out


def block_of(num_nodes: int, processes: int) -> list[int]:
    """The process of each node, by rank (the inverse of `blocks`)."""
    return [p for p, b in enumerate(blocks(num_nodes, processes)) for _ in b]


@dataclass(frozen=True)
class Hosting:
    """What one process of a run hosts: its nodes and, optionally, other roles.

    Built by the launcher before any process starts, and sent to the process (it pickles).

    Attributes:
        process: this process's index among the run's processes.
        owner: the process of each node, by rank (`owner[r]`); its length is the run's num_nodes.
        roles: the participants other than nodes this process holds (e.g. `SERVER_ROLE`); empty for most runs.
        returns_model: whether this process computes the global model itself at the end (rather than receiving
            it from the process that holds node 0).
        run_roles: the roles the run has, in whichever process (each is held beside node 0).
    """

    process: int
    owner: tuple[int, ...]
    roles: frozenset[str] = frozenset()
    returns_model: bool = False
    run_roles: frozenset[str] = frozenset()

    def role_process(self, role: str) -> int | None:
        """The process holding `role` (the one holding node 0), or None when the run has no such role.

        Args:
            role: e.g. `SERVER_ROLE`.

        Returns:
            The process's index, or None.
        """
        return self.owner[0] if role in self.run_roles else None

    @property
    def processes(self) -> int:
        """How many processes the run has."""
        return max(self.owner) + 1

    @property
    def nodes(self) -> range:
        """The nodes this process hosts (contiguous ranks)."""
        mine = [r for r, p in enumerate(self.owner) if p == self.process]
        return range(mine[0], mine[-1] + 1) if mine else range(0)


@dataclass
class Peers:
    """How a process reaches the run's other processes, once its process group is up (process-local: not sent).

    Attributes:
        store: a client of the run's key-value store.
        address: the store's host.
        port: the store's port.
        run_key: a prefix unique to this run in that store (several runs may share one store).
        start: the run's start on this machine's clock (time.perf_counter), which nodes' wall times count from.
        timeout: the process group's timeout.
    """

    store: Any
    address: str
    port: int
    run_key: str
    start: float
    timeout: timedelta


@dataclass(frozen=True)
class ProcessBackend:
    """A backend as a launcher sees it: what runs inside one process, and the few facts a launcher needs.

    Attributes:
        name: fit's backend= ("sim", "torch").
        run: run(plan, sinks, hosting, peers) -> [(log, state), ...] for the nodes this process hosts, in rank
            order (state: the global model's state dict where this process holds it, else None). peers is None
            when the run is one process (the launcher started nothing).
        one_node_per_process: each process hosts exactly one node (torch.distributed); otherwise a block.
        group_backend: the torch.distributed backend for the process group, given the devices of the nodes that
            share this machine.
        group_timeout: the process group's timeout for a plan.
        passthrough: failures a process reports that reach the caller as themselves, as one process raises them.
        processes_take_gpus: process p of a local launch runs its CUDA nodes on GPU p (mod the GPUs).
        choose_execution: which execution (fit's execution=: "sequential", "fused" or "auto") the backend's nodes
            run, decided before any node starts: choose_execution(execution, model=..., first_batch=...,
            num_nodes=..., devices=..., minibatch_size=..., autocast=..., seed=..., resume_from=...,
            optim_spec=..., one_replica=...) -> ("sequential" | "fused", why); None: every node runs on its own
            (sequential_execution).
    """

    name: str
    run: Callable[["RunPlan", "RunSinks", Hosting, Peers | None], list[Any]]
    one_node_per_process: bool
    group_backend: Callable[[Sequence[torch.device]], str]
    group_timeout: Callable[["RunPlan"], timedelta]
    passthrough: tuple[type, ...] = ()
    processes_take_gpus: bool = False
    choose_execution: Callable[..., tuple[str, str]] | None = None

    def execution(self, execution: str, **probe: Any) -> tuple[str, str]:
        """The execution this backend's nodes run for fit's execution= (what choose_execution decides, or
        sequential_execution's answer), and why."""
        if self.choose_execution is None:
            return sequential_execution(execution, backend=self.name)
        return self.choose_execution(execution, **probe)


def sequential_execution(execution: str, *, backend: str, **_: Any) -> tuple[str, str]:
    """The execution of a backend that runs each node on its own: sequential; "fused" is refused, "auto" falls back
    with a FusedFallbackWarning (the sim backend alone batches nodes, exogym.backends.sim.fused.choose)."""
    if execution == "sequential":
        return "sequential", "requested"
    reason = f"fused execution batches the nodes of one process (backend='sim'), got backend={backend!r}"
    if execution == "fused":
        raise ValueError(f"execution='fused' cannot run here: {reason}; use execution='sequential' "
                         "(or 'auto', which falls back to it)")
    warnings.warn(f"execution='auto' runs the nodes sequentially: {reason}", FusedFallbackWarning, stacklevel=3)
    return "sequential", reason
