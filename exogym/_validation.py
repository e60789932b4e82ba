"""Argument checks shared by every public constructor: one place for the wording of errors."""

from __future__ import annotations

import difflib
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable

# The largest run seed: torch's generators take seeds up to 2**64 - 1, and epoch e's data order is seeded with
# seed + e (DistributedSampler), so a seed below 2**63 leaves every epoch a valid seed. numpy's SeedSequence and
# Python's random take any non-negative int; each node's own seed is mixed down to 63 bits (exogym.engine.rng).
MAX_SEED = 2**63 - 1


def reject_unknown_kwargs(owner: str, unknown: dict[str, Any], accepted: Iterable[str]) -> None:
    """Raise a TypeError naming the unknown keywords, close matches and every accepted keyword.

    The original project turned unknown keywords into attributes, so a typo silently changed
    the experiment; here a typo stops it before anything runs.
    """
    if not unknown:
        return
    accepted = sorted(set(accepted))
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, accepted, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{owner} got unexpected keyword argument(s) {', '.join(parts)}; "
        f"accepted keywords are: {', '.join(accepted)}"
    )


def init_keywords(cls: type) -> list[str]:
    """Every named keyword the constructors along cls's MRO accept (what a user may pass)."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                names.append(p.name)
    return names


def check_int(name: str, value: Any, *, minimum: int, maximum: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be in {minimum}..{maximum}, got {value!r}")


def check_number(name: str, value: Any, *, minimum: float | None = None, positive: bool = False,
                 maximum: float | None = None, allow_none: bool = False, finite: bool = False) -> None:
    """finite=True: inf and -inf are refused too (a learning rate of inf turns every weight into nan at once)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if value != value:  # NaN
        raise ValueError(f"{name} must be a number, got nan")
    if finite and isinstance(value, float) and not math.isfinite(value):  # an int is finite, and may not fit a float
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def caller_level() -> int:
    """The stacklevel, for warnings.warn, of the first frame outside the exogym package (the user's call)."""
    package = str(Path(__file__).resolve().parent) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level
