"""`from exogym.compat.aux_utils import get_device`, as the original EXO Gym's example scripts import it."""

from __future__ import annotations

from exogym.engine.devices import default_device

__all__ = ["get_device"]


def get_device() -> str:
    """The best device type here: "cuda", else "mps", else "cpu" (a string, as the original's scripts compare it)."""
    return default_device().type
