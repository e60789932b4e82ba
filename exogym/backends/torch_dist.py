"""The torch backend: every node is an OS process, and collectives are torch.distributed calls.

Two ways in, one per-node body (`_run_node`):
- launched: the script runs under torchrun (RANK and WORLD_SIZE are set) with backend="torch": this process runs
  node RANK; the process group comes from torchrun's environment (MASTER_ADDR/MASTER_PORT), a CUDA node runs on
  cuda:LOCAL_RANK. Every process returns the global model and a record of every node (gathered at the end).
- local spawn (anywhere else): one process per node on this machine, supervised from the caller
  (exogym/backends/torch_spawn.py).
The process group is nccl when every node has a GPU of its own, gloo otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from exogym.global_model import global_state_dict
from exogym.backends.torch_comm import TorchTransport
from exogym.backends.torch_heartbeat import Heartbeat

if TYPE_CHECKING:
    from exogym.plan import RunPlan
    from exogym.record import NodeLog

__all__ = ["run_torch", "LaunchEnv", "launch_env", "launch_for_fit", "check_launch", "pick_backend",
           "PROCESS_GROUP_TIMEOUT", "process_group_timeout"]

# How long a collective may wait for the other members before torch.distributed gives up is fit's node_timeout (the
# sim's watchdog limit, default 600 s). A node that raises or dies ends a local run at once anyway; this bounds what
# cannot be seen from outside: a node that never reaches a collective, or nodes deadlocked in mismatched ones, which
# the error then names (exogym/backends/torch_heartbeat.py). node_timeout=None asks for no limit; torch.distributed
# needs a finite one, so that is PROCESS_GROUP_TIMEOUT (a week).
PROCESS_GROUP_TIMEOUT = timedelta(days=7)


def process_group_timeout(node_timeout: float | None) -> timedelta:
    """The process group's timeout for fit's node_timeout (seconds; None: PROCESS_GROUP_TIMEOUT)."""
    return PROCESS_GROUP_TIMEOUT if node_timeout is None else timedelta(seconds=node_timeout)


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int

    def node_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        """Each process drives one GPU: a CUDA node runs on cuda:LOCAL_RANK, whatever index it was given."""
        return [torch.device("cuda", self.local_rank) if d.type == "cuda" else d for d in devices]


def launch_env() -> LaunchEnv | None:
    """The torchrun launch this process is part of (RANK and WORLD_SIZE are set), or None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(name, "0")
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"the environment variable {name}={raw!r} must be an integer (torchrun sets it); "
                             "unset RANK and WORLD_SIZE to run without torchrun") from None
    return LaunchEnv(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


def check_launch(num_nodes: int, env: LaunchEnv) -> None:
    """Under torchrun, one process is one node: num_nodes must be the number of processes."""
    if num_nodes != env.world_size:
        raise ValueError(f"num_nodes={num_nodes} but torchrun started WORLD_SIZE={env.world_size} processes; under "
                         f"torchrun each process is one node, so pass num_nodes={env.world_size}, or launch "
                         f"{num_nodes} processes (--nnodes x --nproc-per-node = {num_nodes})")
    if not 0 <= env.rank < env.world_size:
        raise ValueError(f"RANK={env.rank} must lie in 0..{env.world_size - 1} (WORLD_SIZE={env.world_size})")


def launch_for_fit(backend: str, num_nodes: int, *, checkpoint_dir_shared: bool) -> LaunchEnv | None:
    """Trainer.fit's launched-mode check: this process's launch when backend="torch" runs under torchrun, else None.

    Under torchrun, backend="sim" is allowed (each process then simulates every node) but warned about: no
    environment variable silently changes the backend the caller asked for.
    """
    env = launch_env() if backend == "torch" else None
    if env is None:
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            warnings.warn(f"RANK and WORLD_SIZE are set (torchrun?), but backend={backend!r} runs all {num_nodes} "
                          "nodes in this process, and so in every process; pass backend='torch' to run one node per "
                          "process", stacklevel=3)
        return None
    check_launch(num_nodes, env)
    if not checkpoint_dir_shared:
        raise ValueError("under torchrun, checkpoint_interval needs checkpoint_dir= or run_name=, so that every "
                         "process writes into the same folder (the default run name holds a timestamp)")
    return env


def pick_backend(devices: Sequence[torch.device]) -> str:
    """nccl when every node has a GPU of its own; gloo otherwise (CPU, MPS, or GPUs shared by several nodes)."""
    if all(d.type == "cuda" for d in devices) and len(set(devices)) == len(devices) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def run_torch(plan: "RunPlan") -> list[tuple["NodeLog", dict[str, torch.Tensor] | None]]:
    """Run the plan's nodes on torch.distributed; return (log, final state) per node in rank order.

    Under torchrun only this process's node runs; the logs of all nodes come back (an all-gather at the end), and
    the state in the first entry is this process's copy of the global model (the same on every process).
    """
    if not dist.is_available():
        raise RuntimeError("backend='torch' needs torch.distributed, which this build of torch lacks; use "
                           "backend='sim', or install a torch build with distributed support")
    env = launch_env()
    if env is None:
        from exogym.backends.torch_spawn import run_spawned
        return run_spawned(plan)
    return _run_launched(plan, env)


_runs_started = 0  # per process: keys in a store shared by several runs (torchrun: one per job) stay apart


def _run_node(plan: "RunPlan", rank: int, backend: str, start_time: float, timeout: timedelta,
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
    try:
        node = plan.make_node(rank, start_time)
        plan.node_rng(rank).activate()  # this process is the node: its streams stay in place for the whole run
        log, state = node.run(comm)
    finally:
        if comm.heartbeat is not None:
            comm.heartbeat.stop()
    log.comm["process_peak_rss_mb"] = _peak_rss_mb()  # the caller's record measures one process; each node is one
    return node, comm, log, state


def _launch_store() -> Any:
    """Under torchrun: a client of the job's store (MASTER_ADDR:MASTER_PORT) for the heartbeat; None if unreachable."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - the run works without it; a timeout then names only the waiting node
        return None


def _peak_rss_mb() -> float | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux


def _run_launched(plan: "RunPlan", env: LaunchEnv) -> list[tuple["NodeLog", dict[str, torch.Tensor] | None]]:
    check_launch(plan.num_nodes, env)
    plan = dataclasses.replace(plan, devices=env.node_devices(plan.devices))
    device = plan.devices[env.rank]  # each process has a GPU of its own (LOCAL_RANK), so a GPU node means nccl
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    owns_group = not dist.is_initialized()  # a script may have set up torch.distributed itself; then it keeps it
    timeout = process_group_timeout(plan.node_timeout)
    if owns_group:
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    elif dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise ValueError(f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                         f"{dist.get_world_size()}, but RANK={env.rank}, WORLD_SIZE={env.world_size}; call "
                         "fit() in a process torchrun started, before or without your own init_process_group")
    else:  # the script's own process group decides where collectives run
        backend = "nccl" if device.type == "cuda" and "nccl" in str(dist.get_backend()) else "gloo"
    try:
        node, comm, log, state = _run_node(plan, env.rank, backend, time.perf_counter(), timeout, _launch_store())
        # node.run hands the global model to node 0 only; every process returns it: one more (uncounted) average.
        everyone = global_state_dict(node.model, node.strategy, comm)
        state = everyone if state is None else state
        logs: list[Any] = [None] * env.world_size
        dist.all_gather_object(logs, log)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return [(logs[0], state)] + [(lg, None) for lg in logs[1:]]
