"""The torch backend: every node is an OS process, and collectives are torch.distributed calls.

Two ways in, one per-node body (`exogym.backends.torch.node_process.run_node`):
- launched: the script runs under torchrun (RANK and WORLD_SIZE are set) with backend="torch": this process runs
  node RANK; the process group comes from torchrun's environment (MASTER_ADDR/MASTER_PORT), a CUDA node runs on
  cuda:LOCAL_RANK. Every process returns the global model and a record of every node (gathered at the end).
- local spawn (anywhere else): one process per node on this machine, supervised from the caller
  (exogym.backends.torch.spawn).
The process group is nccl when every node has a GPU of its own, gloo otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from exogym.backends.torch.node_process import process_group_timeout, run_node
from exogym.backends.torch.spawn import run_spawned
from exogym.engine.global_model import global_state_dict

if TYPE_CHECKING:
    from exogym.engine.plan import RunPlan
    from exogym.runs.record import NodeLog

__all__ = ["run_torch", "LaunchEnv", "launch_env", "launch_for_fit", "check_launch"]

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


def launch_for_fit(backend: str, num_nodes: int, *, processes: int, checkpoint_dir_shared: bool) -> LaunchEnv | None:
    """Trainer.fit's launched-mode check: this process's place when the script runs under torchrun with more than
    one process, else None. backend="torch": each process is one node (num_nodes must be the world size).
    backend="sim": the world's processes share the simulation, a block of nodes each (processes= may be left at
    1, or must equal the world size)."""
    env = launch_env()
    if env is None or backend == "sim" and env.world_size == 1:
        return None
    if backend == "torch":
        check_launch(num_nodes, env)
    else:
        if processes not in (1, env.world_size):
            raise ValueError(f"processes={processes} but torchrun started WORLD_SIZE={env.world_size} processes; under "
                             f"torchrun the simulation runs on the processes torchrun started: drop processes= or "
                             f"pass processes={env.world_size}")
        if env.world_size > num_nodes:
            raise ValueError(f"torchrun started WORLD_SIZE={env.world_size} processes for num_nodes={num_nodes}: each "
                             f"process simulates at least one node; launch at most {num_nodes} processes")
        if not 0 <= env.rank < env.world_size:
            raise ValueError(f"RANK={env.rank} must lie in 0..{env.world_size - 1} (WORLD_SIZE={env.world_size})")
    if not checkpoint_dir_shared:
        raise ValueError("under torchrun, checkpoint_interval needs checkpoint_dir= or run_name=, so that every "
                         "process writes into the same folder (the default run name holds a timestamp)")
    return env


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
        return run_spawned(plan)
    return _run_launched(plan, env)


def _launch_store() -> Any:
    """Under torchrun: a client of the job's store (MASTER_ADDR:MASTER_PORT) for the heartbeat; None if unreachable."""
    try:
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=30))
    except Exception:  # noqa: BLE001 - the run works without it; a timeout then names only the waiting node
        return None


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
        node, comm, log, state = run_node(plan, env.rank, backend, time.perf_counter(), timeout, _launch_store())
        # node.run hands the global model to node 0 only; every process returns it: one more (uncounted) average.
        everyone = global_state_dict(node.model, node.strategy, comm)
        state = everyone if state is None else state
        logs: list[Any] = [None] * env.world_size
        dist.all_gather_object(logs, log)
    finally:
        if owns_group:
            dist.destroy_process_group()
    return [(logs[0], state)] + [(lg, None) for lg in logs[1:]]
