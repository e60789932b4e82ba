"""Which launcher runs a fit call: from its backend, its processes= and the environment, checked before any node
starts."""

from __future__ import annotations

import torch.distributed as dist

from exogym.backends.hosting import ProcessBackend
from exogym.backends.sim import SIM
from exogym.backends.torch.node_process import TORCH
from exogym.launch.environment import Environment
from exogym.launch.launchers import InProcess, Launcher, LocalProcesses, Torchrun

__all__ = ["BACKENDS", "choose_launcher"]

BACKENDS: dict[str, ProcessBackend] = {"sim": SIM, "torch": TORCH}


def choose_launcher(environment: Environment, backend: str, num_nodes: int, *, processes: int = 1,
                    port: int | None = None, checkpoint_dir_shared: bool = True,
                    roles: frozenset[str] = frozenset()) -> Launcher:
    """The launcher for a run, its layout checked.

    Under torchrun with more than one process, backend="torch" runs one node per process (num_nodes must be the
    world size) and backend="sim" shares the simulation among the processes, a block of nodes each (processes= may
    be left at 1, or must equal the world size). Elsewhere the sim runs in this process (processes=1) or in P local
    processes, and the torch backend in one local process per node.

    Args:
        environment: this process's place (exogym.launch.environment.detect_environment).
        backend: fit's backend ("sim" or "torch"), already checked.
        num_nodes: the run's nodes.
        processes: fit's processes=.
        port: the rendezvous port of local processes (None: a free one).
        checkpoint_dir_shared: whether every process would write checkpoints into the same folder.
        roles: participants other than nodes, hosted beside node 0 (e.g. a strategy's server).

    Returns:
        The launcher.

    Raises:
        ValueError: the layout does not fit the torchrun launch, or checkpoints would not land in one folder.
        RuntimeError: backend="torch" on a torch build without torch.distributed.
    """
    spec = BACKENDS[backend]
    if backend == "torch" and not dist.is_available():
        raise RuntimeError("backend='torch' needs torch.distributed, which this build of torch lacks; use "
                           "backend='sim', or install a torch build with distributed support")
    env = environment
    if not env.torchrun or backend == "sim" and env.world_size == 1:
        if backend == "sim" and processes == 1:
            return InProcess(spec, num_nodes, roles=roles)
        return LocalProcesses(spec, num_nodes, num_nodes if spec.one_node_per_process else processes, port=port,
                              roles=roles)
    if spec.one_node_per_process:
        if num_nodes != env.world_size:
            raise ValueError(f"num_nodes={num_nodes} but torchrun started WORLD_SIZE={env.world_size} processes; "
                             f"under torchrun each process is one node, so pass num_nodes={env.world_size}, or launch "
                             f"{num_nodes} processes (--nnodes x --nproc-per-node = {num_nodes})")
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
    return Torchrun(spec, num_nodes, env, roles=roles)
