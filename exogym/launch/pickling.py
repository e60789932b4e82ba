"""Before any process starts: what a launcher sends each process must pickle, and name nothing a fresh process
cannot import (a class of a notebook or of `python -c`)."""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

__all__ = ["check_picklable"]


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
