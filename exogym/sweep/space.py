"""What a sweep varies: a grid of values, or ranges for a search, and the seeds every configuration runs with.

    grid(H=[10, 30, 100], outer_lr=[0.3, 0.7], seed=[0, 1, 2])            # 6 configurations x 3 seeds
    grid(strategy="ddp", nodes=[2, 4]) + grid(strategy="diloco", nodes=[2, 4], outer_lr=[0.3, 0.7])  # a union
    space(H=Int(5, 200, log=True), outer_lr=Float(0.1, 1.0), seed=[0, 1])   # for search="random" or "tpe"

A configuration is a dict of parameter values; `seed` is not a parameter but the list of seeds every
configuration is run with, and its results are averaged over them (never searched). Every check here runs
when the space is built, before any trial starts.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Union

__all__ = ["Int", "Float", "Choice", "Space", "grid", "space", "config_key", "run_name", "Value"]

Value = Union[int, float, str, bool, None]  # what a parameter may hold: JSON and Optuna can store it


def _check_value(name: str, value: Any) -> None:
    if not (value is None or isinstance(value, (int, float, str, bool))):
        raise TypeError(f"parameter {name!r}: values must be int, float, str, bool or None (they are stored "
                        f"in the study and the table), got {type(value).__name__} {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"parameter {name!r}: values must be finite, got {value!r}")


@dataclass(frozen=True)
class Int:
    """Integers from low to high, both included; log=True samples evenly in log space (low must be >= 1)."""

    low: int
    high: int
    log: bool = False

    def check(self, name: str) -> None:
        for end in ("low", "high"):
            value = getattr(self, end)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"parameter {name!r}: Int {end} must be an int, got {value!r}; use Float for "
                                "real numbers")
        _check_range(name, self.low, self.high, self.log)


@dataclass(frozen=True)
class Float:
    """Real numbers from low to high; log=True samples evenly in log space (low must be > 0)."""

    low: float
    high: float
    log: bool = False

    def check(self, name: str) -> None:
        for end in ("low", "high"):
            value = getattr(self, end)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise TypeError(f"parameter {name!r}: Float {end} must be a finite number, got {value!r}")
        _check_range(name, self.low, self.high, self.log)


def _check_range(name: str, low: float, high: float, log: bool) -> None:
    if low > high:
        raise ValueError(f"parameter {name!r}: the range {low}..{high} is empty (low > high); swap the ends")
    if log and low <= 0:
        raise ValueError(f"parameter {name!r}: a log range must lie above zero, got {low}..{high}; start it at a "
                         "positive value, or drop log")


@dataclass(frozen=True)
class Choice:
    """One of a list of values (a grid's axis, or a categorical parameter of a search)."""

    values: tuple[Value, ...]

    def check(self, name: str) -> None:
        if not self.values:
            raise ValueError(f"parameter {name!r}: the list of values is empty; give at least one value")
        for v in self.values:
            _check_value(name, v)
        keys = [json.dumps(v) for v in self.values]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ValueError(f"parameter {name!r} lists {', '.join(twice)} more than once; name each value once")


Dimension = Union[Int, Float, Choice]


def _dimension(name: str, spec: Any) -> Dimension:
    if isinstance(spec, (Int, Float, Choice)):
        dim = spec
    elif isinstance(spec, (list, tuple, range)):
        dim = Choice(tuple(spec))
    else:
        _check_value(name, spec)
        dim = Choice((spec,))  # one value: fixed for every configuration
    dim.check(name)
    return dim


def _seeds(spec: Any) -> tuple[int, ...]:
    seeds = tuple(spec) if isinstance(spec, (list, tuple, range)) else (spec,)
    if not seeds:
        raise ValueError("seed: the list of seeds is empty; give at least one (e.g. seed=[0])")
    bad = [s for s in seeds if not isinstance(s, int) or isinstance(s, bool) or s < 0]
    if bad:
        raise ValueError(f"seed: seeds must be ints >= 0, got {bad!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seed: {list(seeds)} names a seed twice; name each once")
    return seeds


def config_key(config: Mapping[str, Value]) -> str:
    """The identity of a configuration (its values; order and seeds do not matter)."""
    return json.dumps(dict(config), sort_keys=True)


def _text(value: Value) -> str:
    return repr(value) if isinstance(value, float) else str(value).lower() if value is None else str(value)


def run_name(config: Mapping[str, Value], seed: int) -> str:
    """The run folder of one configuration and seed: "H=30,outer_lr=0.6,seed=0" (a short hash is added when
    characters had to be replaced or the name was cut, so that two configurations never share a folder)."""
    text = ",".join(f"{k}={_text(v)}" for k, v in config.items())
    clean = re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)
    if clean != text or len(clean) > 120:
        clean = f"{clean[:100]}~{hashlib.sha1(config_key(config).encode()).hexdigest()[:8]}"
    return f"{clean},seed={seed}" if clean else f"seed={seed}"


@dataclass(frozen=True)
class Space:
    """Parameters to vary (a union of one or more sub-spaces) and the seeds to average over."""

    parts: tuple[dict[str, Dimension], ...]
    seeds: tuple[int, ...] = (0,)

    def __add__(self, other: "Space") -> "Space":
        if not isinstance(other, Space):
            return NotImplemented
        if self.seeds != other.seeds:
            raise ValueError(f"the spaces joined with + have different seeds ({list(self.seeds)} and "
                             f"{list(other.seeds)}); give both the same seed=[...]")
        return Space(self.parts + other.parts, self.seeds)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys(n for part in self.parts for n in part))

    @property
    def is_grid(self) -> bool:
        """Every parameter a list of values (ranges cannot be enumerated)."""
        return all(isinstance(d, Choice) for part in self.parts for d in part.values())

    def _check_grid(self) -> None:
        if not self.is_grid:
            ranges = [n for part in self.parts for n, d in part.items() if not isinstance(d, Choice)]
            raise ValueError(f"a grid lists values; {', '.join(sorted(set(ranges)))} "
                             f"{'is a range' if len(set(ranges)) == 1 else 'are ranges'}: use search='random' or "
                             "'tpe' with trials=N, or give lists of values")

    def count(self) -> int:
        """How many configurations the grid has (a configuration two parts share counted once), without listing
        them: the parts' products, less what earlier parts hold (inclusion-exclusion over the earlier parts with
        the same names)."""
        self._check_grid()
        total = 0
        for k, keys in enumerate(self._keys):
            same = [j for j in range(k) if self._keys[j].keys() == keys.keys()]
            if len(same) > 10:  # 2**10 intersections: counting the cells one by one is cheaper
                start = sum(self._sizes[:k])
                total += sum(self.cell(c) is not None for c in range(start, start + self._sizes[k]))
                continue
            for r in range(len(same) + 1):
                for subset in itertools.combinations(same, r):
                    total += (-1) ** r * math.prod(len(keys[n].intersection(*(self._keys[j][n] for j in subset)))
                                                   for n in keys)
        return total

    def cells(self) -> int:
        """How many cells the grid's parts hold together (a configuration two parts share is two cells)."""
        self._check_grid()
        return sum(self._sizes)

    def cell(self, index: int) -> dict[str, Value] | None:
        """The configuration in grid cell `index` (the parts in order, each in itertools.product's order: the last
        parameter varies fastest), computed without listing the others; None when an earlier part holds it (the
        configuration is that part's)."""
        if not 0 <= index < self.cells():
            raise IndexError(f"cell {index} is outside the grid's {self.cells()} cells")
        k = 0
        while index >= self._sizes[k]:
            index -= self._sizes[k]
            k += 1
        values: dict[str, Value] = {}
        for name, dim in reversed(list(self.parts[k].items())):
            index, i = divmod(index, len(dim.values))
            values[name] = dim.values[i]
        config = self.ordered(values)
        keys = {n: json.dumps(v) for n, v in config.items()}
        held = any(self._keys[j].keys() == keys.keys() and all(keys[n] in self._keys[j][n] for n in keys)
                   for j in range(k))
        return None if held else config

    def configurations(self) -> list[dict[str, Value]]:
        """Every configuration of the grid, in order, each once (a listing: for a small grid only)."""
        return [c for c in map(self.cell, range(self.cells())) if c is not None]

    @functools.cached_property
    def _sizes(self) -> list[int]:
        return [math.prod(len(d.values) for d in part.values()) for part in self.parts]

    @functools.cached_property
    def _keys(self) -> list[dict[str, set[str]]]:
        """Each part's values per name, as JSON (config_key's identity of a value: 1 and 1.0 differ)."""
        return [{n: {json.dumps(v) for v in d.values} for n, d in part.items()} for part in self.parts]

    def ordered(self, config: Mapping[str, Value]) -> dict[str, Value]:
        """`config` in the space's order of names (its run folders' names are made in this order)."""
        return {n: config[n] for n in self.names if n in config}

    def choices(self, name: str) -> tuple[Value, ...]:
        """Every value `name` takes in any part of a grid (Optuna records one categorical per name)."""
        values = [v for part in self.parts if name in part for v in part[name].values]
        return tuple({json.dumps(v): v for v in values}.values())

    def branch(self) -> str | None:
        """For a search over a union: the parameter whose value picks the part (one value in each part,
        different values in different parts), e.g. the strategy. None for a single part."""
        if len(self.parts) == 1:
            return None
        for name in self.parts[0]:
            dims = [part.get(name) for part in self.parts]
            if all(isinstance(d, Choice) and len(d.values) == 1 for d in dims):
                keys = [json.dumps(d.values[0]) for d in dims]
                if len(set(keys)) == len(keys):
                    return name
        raise ValueError("a search over a union of spaces needs one parameter that tells the parts apart (one "
                         "value in each part, e.g. strategy='ddp' + strategy='diloco'); these parts share none")

    def to_json(self) -> dict[str, Any]:
        def dim(d: Dimension) -> dict[str, Any]:
            if isinstance(d, Choice):
                return {"values": list(d.values)}
            return {"type": type(d).__name__.lower(), "low": d.low, "high": d.high, "log": d.log}
        return {"parts": [{n: dim(d) for n, d in part.items()} for part in self.parts], "seeds": list(self.seeds)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Space":
        def dim(d: Mapping[str, Any]) -> Dimension:
            if "values" in d:
                return Choice(tuple(d["values"]))
            return (Int if d["type"] == "int" else Float)(d["low"], d["high"], d["log"])
        return cls(tuple({n: dim(d) for n, d in part.items()} for part in data["parts"]), tuple(data["seeds"]))

    def describe(self) -> str:
        def one(d: Dimension) -> str:
            if isinstance(d, Choice):
                return " ".join(_text(v) for v in d.values)
            return f"{d.low}..{d.high}{' (log)' if d.log else ''}"
        parts = ["; ".join(f"{n}: {one(d)}" for n, d in part.items()) or "(no parameters)" for part in self.parts]
        return " + ".join(f"[{p}]" if len(parts) > 1 else p for p in parts) + f"; seeds {list(self.seeds)}"


def _build(params: Mapping[str, Any]) -> Space:
    params = dict(params)
    seeds = _seeds(params.pop("seed")) if "seed" in params else (0,)
    return Space(({name: _dimension(name, spec) for name, spec in params.items()},), seeds)


def grid(**params: Any) -> Space:
    """Every combination of the listed values (a single value is fixed); seed=[...] are the seeds each
    configuration runs with (default [0]). Join grids with + for configurations that are not one product."""
    _check_some_parameter("grid", params)
    out = _build(params)
    out.count()  # ranges are refused here, with the fix (nothing is listed: a grid may be huge)
    return out


def _check_some_parameter(kind: str, params: Mapping[str, Any]) -> None:
    """A grid of no parameter (seeds alone) is refused: its one configuration gives the run function nothing to
    read, which is a call that forgot its values far more often than a sweep meant that way."""
    if not set(params) - {"seed"}:
        raise ValueError(f"{kind}() needs at least one parameter, got {'only seed=' if params else 'none'}: list the "
                         f"values to try ({kind}(H=[10, 30])); to run one configuration over several seeds, fix its "
                         f"values ({kind}(H=30, seed=[0, 1, 2]))")


def space(**params: Any) -> Space:
    """A search space: Int(low, high, log=...), Float(low, high, log=...), or a list of values (categorical);
    seed=[...] as for grid. Used with search="random" or "tpe" and trials=N."""
    return _build(params)

