"""Before any process starts: what a launcher sends each process must pickle, and name nothing a fresh process
cannot import (a class of a notebook or of `python -c`); and how it is sent: one buffer of bytes.

Why bytes: multiprocessing pickles a process's arguments with torch's reducers, which move every tensor to shared
memory and pass it as one file descriptor, and the forkserver passes at most about 250 to a process it starts
("ValueError: too many fds"); a model of a few hundred tensors could not start. torch.save writes the tensors by
value into one buffer, whatever their number, which the launcher writes into a pipe once the process has started
and the process reads back, then drops (exogym.launch.worker.process_main)."""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import torch

__all__ = ["check_picklable", "to_bytes", "from_bytes"]


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


def to_bytes(obj: Any) -> memoryview:
    """`obj` (a plan for one process) as one buffer, its tensors by value: what a launcher hands a process it starts,
    whatever the number of tensors (see the module docstring). torch.save's format: the reader builds each tensor
    from the buffer directly (plain pickle would go through a second copy of every storage: 3x the state at the
    peak, against 2x; benchmarks/bench_plan_handoff.py)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    return buffer.getbuffer()


def from_bytes(data: Any) -> Any:
    """What to_bytes wrote, in the started process (a trusted buffer: the caller's own plan)."""
    return torch.load(io.BytesIO(data), weights_only=False)
