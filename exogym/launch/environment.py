"""Where this process stands: alone on its machine, or one process of a torchrun launch. The environment variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are read here and nowhere
else."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = ["Environment", "detect_environment"]


@dataclass(frozen=True)
class Environment:
    """This process's place in the job that started it.

    Attributes:
        torchrun: whether torchrun started this process (RANK and WORLD_SIZE are set); False: a process of its own.
        rank: this process's index among the job's processes (0 alone).
        world_size: how many processes the job has (1 alone).
        local_rank: this process's index on its machine.
        local_world_size: how many of the job's processes run on this machine.
        main_address: the job's store host (MASTER_ADDR), None alone.
        main_port: the job's store port (MASTER_PORT), None alone.
    """

    torchrun: bool = False
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    main_address: str | None = None
    main_port: int | None = None

    @property
    def is_main(self) -> bool:
        """Whether this process holds the run folders and the loggers (rank 0)."""
        return self.rank == 0

    def node_devices(self, devices: Sequence[torch.device]) -> list[torch.device]:
        """Under torchrun each process drives one GPU: a CUDA node runs on cuda:LOCAL_RANK, whatever index it was
        given; elsewhere the devices as they are."""
        if not self.torchrun:
            return list(devices)
        return [torch.device("cuda", self.local_rank) if d.type == "cuda" else d for d in devices]

    def nodes_on_this_machine(self, num_nodes: int) -> int:
        """How many of num_nodes this machine holds: all of them, or under torchrun its processes' share."""
        if 0 < self.local_world_size <= self.world_size:
            return -(-num_nodes * self.local_world_size // self.world_size)
        return num_nodes


def _strict_int(environ: Mapping[str, str], name: str, default: str = "0") -> int:
    raw = environ.get(name, default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"the environment variable {name}={raw!r} must be an integer (torchrun sets it); unset RANK "
                         "and WORLD_SIZE to run without torchrun") from None


def detect_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """Read this process's environment, once per fit call.

    Args:
        environ: the variables to read (default: os.environ).

    Returns:
        The torchrun launch this process is part of (RANK and WORLD_SIZE set), or a process of its own; a machine's
        share of a job (WORLD_SIZE and LOCAL_WORLD_SIZE, whole numbers) is kept either way, for the memory check.

    Raises:
        ValueError: RANK, WORLD_SIZE or LOCAL_RANK is set under torchrun but is not an integer.
    """
    environ = os.environ if environ is None else environ
    world, local = environ.get("WORLD_SIZE", ""), environ.get("LOCAL_WORLD_SIZE", "")
    share = {"world_size": int(world), "local_world_size": int(local)} if world.isdigit() and local.isdigit() and \
        0 < int(local) <= int(world) else {}
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return Environment(**share)
    port = environ.get("MASTER_PORT", "")
    return Environment(torchrun=True, rank=_strict_int(environ, "RANK"), local_rank=_strict_int(environ, "LOCAL_RANK"),
                       main_address=environ.get("MASTER_ADDR"), main_port=int(port) if port.isdigit() else None,
                       **{"local_world_size": share.get("local_world_size", 0),
                          "world_size": _strict_int(environ, "WORLD_SIZE")})
