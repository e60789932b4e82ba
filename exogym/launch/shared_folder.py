"""Before a run over several torchrun processes trains: every process must see the same checkpoint folder, since each
writes its own nodes' files there and the process holding node 0 publishes the checkpoint once all are in. The main
process writes a token file into the folder, every process reads it back through its own path, and they compare in
the job's store; a process that does not see it stops the run on every rank, in one line, before any node starts."""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["check_shared_folder"]


def check_shared_folder(store: Any, key: str, rank: int, world_size: int, root: Path,
                        timeout: timedelta = timedelta(seconds=60)) -> None:
    """Check that every rank of the job sees `root` as the same folder.

    Args:
        store: a client of the job's store.
        key: a prefix for this check in it.
        rank: this process's rank.
        world_size: how many processes the job has.
        root: the checkpoint folder, as this process names it.
        timeout: how long to wait for the other ranks' answers.

    Raises:
        ValueError: some rank does not see the folder the main process writes (each machine has its own disk).
    """
    probe = Path(root) / ".exogym-shared-check"
    if rank == 0:
        token = secrets.token_hex(8)
        Path(root).mkdir(parents=True, exist_ok=True)
        probe.write_text(token)
        store.set(f"{key}/token", token)
    store.wait([f"{key}/token"], timeout)
    token = store.get(f"{key}/token").decode()
    try:
        seen = probe.read_text()
    except OSError:
        seen = ""
    store.set(f"{key}/seen/{rank}", "1" if seen == token else "0")
    answers = [f"{key}/seen/{r}" for r in range(world_size)]
    store.wait(answers, timeout)
    blind = [r for r, k in enumerate(answers) if store.get(k) != b"1"]
    if rank == 0:  # every rank has read it: the probe goes
        try:
            os.unlink(probe)
        except OSError:
            pass
    if blind:
        raise ValueError(f"checkpoints need one folder every rank sees, and rank(s) {blind} do not see "
                         f"{str(root)!r} as rank 0 does (each machine has its own disk?): put checkpoint_dir on a "
                         "shared filesystem, or run without checkpoint_interval")

