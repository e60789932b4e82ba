"""Transient slowdowns ("chaos"): windows of simulated time during which a node computes more slowly.

Node speeds (`fit(node_speeds=...)`) are constant stragglers; a slowdown is transient: node `node` computes
`factor` times more slowly from simulated second `from_s` to `to_s`, then at its own speed again (the Decoupled
DiLoCo paper, arXiv:2604.21428, injects such slowdowns beside failures, "inspired by chaos engineering"). fit
takes them as `slowdowns=`:

- a list of `(node, from_s, to_s, factor)`, the windows of one node not overlapping; or
- `RandomSlowdowns(rate, factor, duration, seed)`: each node's slowdowns drawn from the seed as a Poisson process
  in simulated time (`rate` per node per simulated second; the next one starts an exponential gap after the end of
  the last), each lasting `duration` seconds and slowing by `factor` (a number, or a `(low, high)` range drawn
  uniformly).

How a step is timed: a step that starts at clock t and needs w seconds of compute at the node's speed ends at the
time T where the work done by T is w, the node doing 1 second of work per second outside the windows and 1/factor
inside (a window that starts mid-step slows only the rest of it). The w seconds are the node's compute time;
T - t - w is its slowed time (`NodeClock.slowed_s`), which is neither compute nor idle in goodput's count. A step
that no window touches takes exactly w, so a run without slowdowns is the same to the bit.

Determinism: node r's i-th slowdown is a function of (seed, r, i) only (its own random stream, drawn in order), so
the same seed gives the same slowdowns whatever the backend, the execution, the processes and the point a run
resumed from: a resumed run draws them again from the start.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from exogym._validation import check_int, check_number

__all__ = ["RandomSlowdowns", "Slowdown", "SlowdownSchedule", "build_slowdowns", "MAX_WINDOWS_PER_STEP"]

# A step that spans more drawn windows than this is refused: slowdowns far shorter than a step only average out,
# and drawing them would take work and memory without bound (rate=1e6 against a step of 1e9 simulated seconds).
MAX_WINDOWS_PER_STEP = 10_000


@dataclass(frozen=True)
class Slowdown:
    """One slowdown: node `node` computes `factor` times more slowly from simulated second `from_s` to `to_s`.

    Args:
        node: The node's rank.
        from_s: When it starts, in simulated seconds.
        to_s: When it ends (after `from_s`).
        factor: How many times longer its compute takes meanwhile (at least 1).
    """

    node: int
    from_s: float
    to_s: float
    factor: float

    def as_record(self) -> dict[str, float]:
        """The slowdown as a row of the record: `{"node", "from_s", "to_s", "factor"}`.

        Returns:
            The row.
        """
        return {"node": self.node, "from_s": self.from_s, "to_s": self.to_s, "factor": self.factor}


def _check_range(name: str, value: Any, *, minimum: float, positive: bool) -> None:
    """A number, or a (low, high) range of them with low <= high, each checked."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise TypeError(f"RandomSlowdowns {name} must be a number or a (low, high) range, got {value!r}")
        for v in value:
            check_number(f"RandomSlowdowns {name}", v, minimum=minimum, positive=positive, finite=True)
        if value[0] > value[1]:
            raise ValueError(f"RandomSlowdowns {name} range must have low <= high, got {value!r}")
        return
    check_number(f"RandomSlowdowns {name}", value, minimum=minimum, positive=positive, finite=True)


@dataclass(frozen=True)
class RandomSlowdowns:
    """Transient slowdowns for `fit(slowdowns=...)`, drawn from a seed in simulated time.

    Each node's slowdowns are a Poisson process of `rate` per simulated second: the first starts an exponential
    gap (mean 1 / rate) after time 0, each next one the same after the end of the one before, so a node's windows
    never overlap. Each lasts `duration` seconds and slows the node's compute by `factor`; either may be a
    `(low, high)` range, drawn uniformly per slowdown.

    Args:
        rate: Slowdowns per node per simulated second (>= 0; 0: none).
        factor: How many times longer a slowed node's compute takes (>= 1), or a (low, high) range.
        duration: How long a slowdown lasts, in simulated seconds (> 0), or a (low, high) range.
        seed: The seed of the slowdowns' random streams (one per node).

    Raises:
        ValueError: A value out of range (a negative rate, a factor below 1, a duration <= 0, a negative seed).
        TypeError: A value of the wrong type.
    """

    rate: float
    factor: float | tuple[float, float] = 2.0
    duration: float | tuple[float, float] = 10.0
    seed: int = 0

    def __post_init__(self):
        check_number("RandomSlowdowns rate", self.rate, minimum=0.0, finite=True)
        _check_range("factor", self.factor, minimum=1.0, positive=False)
        _check_range("duration", self.duration, minimum=0.0, positive=True)
        check_int("RandomSlowdowns seed", self.seed, minimum=0)


class _Drawn:
    """One node's random slowdowns, drawn in order from its own stream as far as they are asked for."""

    def __init__(self, spec: RandomSlowdowns, rank: int):
        self.spec, self.rank = spec, rank
        self._rng = np.random.default_rng([spec.seed, rank])
        self._end = 0.0  # where the last drawn window ends

    def draw(self) -> Slowdown | None:
        """The next slowdown, or None when the rate is 0."""
        s = self.spec
        if s.rate == 0:
            return None
        start = self._end + float(self._rng.exponential(1.0 / s.rate))
        duration = _value(s.duration, self._rng)
        factor = _value(s.factor, self._rng)
        self._end = start + duration
        return Slowdown(self.rank, start, self._end, factor)


def _value(v: float | tuple[float, float], rng: np.random.Generator) -> float:
    return float(rng.uniform(v[0], v[1])) if isinstance(v, (tuple, list)) else float(v)


class SlowdownSchedule:
    """Every node's slowdowns, in time order: given as a list, or drawn lazily (as far as a node's clock asks).

    Args:
        num_nodes: The run's node count.
        given: Per node, its slowdowns in time order (a list spec), or None for drawn ones.
        drawn: The random spec, or None.
    """

    def __init__(self, num_nodes: int, given: list[list[Slowdown]] | None = None,
                 drawn: RandomSlowdowns | None = None):
        self.num_nodes, self.spec = num_nodes, drawn
        self._windows: list[list[Slowdown]] = given if given is not None else [[] for _ in range(num_nodes)]
        self._ends = [[w.to_s for w in ws] for ws in self._windows]  # each node's window ends, for bisect
        self._draw = [_Drawn(drawn, r) for r in range(num_nodes)] if drawn is not None else None
        self._exhausted = [drawn is None or drawn.rate == 0] * num_nodes

    def _cover(self, rank: int, until: float, start: float | None = None) -> list[Slowdown]:
        """Node `rank`'s windows, drawn at least until one ends after `until` (or the draws are exhausted); no more
        than MAX_WINDOWS_PER_STEP of them after `start` (the step's start) at a time."""
        windows, ends = self._windows[rank], self._ends[rank]
        first = len(windows)
        while not self._exhausted[rank] and (not windows or windows[-1].to_s <= until):
            if len(windows) - first >= MAX_WINDOWS_PER_STEP:
                self._too_many(rank, start, until)
            w = self._draw[rank].draw()
            if w is None:
                self._exhausted[rank] = True
                break
            windows.append(w)
            ends.append(w.to_s)
        return windows

    def stretch(self, rank: int, start: float, work: float) -> float:
        """How long `work` seconds of compute take on node `rank` from clock `start`, slowed where windows fall.

        Args:
            rank: The node.
            start: Its clock when the compute starts.
            work: The compute's seconds at the node's own speed.

        Returns:
            The seconds until it ends: `work` exactly when no window overlaps it, more when one does.
        """
        windows = self._cover(rank, start + work, start)
        i = bisect.bisect_right(self._ends[rank], start)  # the first window ending after start
        if i == len(windows) or windows[i].from_s >= start + work:
            return work
        now, left, first = start, work, i
        while True:
            if i - first >= MAX_WINDOWS_PER_STEP:
                self._too_many(rank, start, now + left)
            if i == len(windows):  # the compute ran past every window drawn so far: draw on
                windows = self._cover(rank, now + left, start)
                if i == len(windows):
                    return now + left - start
            w = windows[i]
            if w.from_s >= now + left:  # done at full speed before the next window
                return now + left - start
            if w.from_s > now:  # full speed until the window
                left -= w.from_s - now
                now = w.from_s
            doable = (w.to_s - now) / w.factor  # the work done by the window's end, at 1/factor speed
            if left <= doable:
                return now + left * w.factor - start
            left -= doable
            now = w.to_s
            i += 1

    def _too_many(self, rank: int, start: float | None, until: float) -> None:
        spec = self.spec
        span = f"from {start:.6g} s to at least {until:.6g} s" if start is not None else f"to {until:.6g} s"
        raise ValueError(f"slowdowns=RandomSlowdowns(rate={spec.rate!r}, duration={spec.duration!r}): one step of "
                         f"node {rank} ({span} of simulated time) spans more than {MAX_WINDOWS_PER_STEP:,} slowdown "
                         "windows; slowdowns that much shorter than a step only average out. Lower rate, or make "
                         "each slowdown last longer (duration), or the node's step shorter (node_speeds, "
                         "device_flops)")

    def during(self, rank: int, until: float) -> list[Slowdown]:
        """Node `rank`'s slowdowns that started before simulated second `until` (its clock at the run's end).

        Args:
            rank: The node.
            until: The end of the span.

        Returns:
            The slowdowns, in time order.
        """
        return [w for w in self._cover(rank, until) if w.from_s < until]

    def describe(self) -> str:
        """The spec as the run's config and announcement write it."""
        if self.spec is not None:
            return repr(self.spec)
        return repr([(w.node, w.from_s, w.to_s, w.factor) for ws in self._windows for w in ws])


def build_slowdowns(num_nodes: int, slowdowns: Any) -> SlowdownSchedule | None:
    """Validate fit's `slowdowns` and make the schedule.

    Args:
        num_nodes: The run's node count.
        slowdowns: A list of `(node, from_s, to_s, factor)`, a `RandomSlowdowns`, or None.

    Returns:
        The schedule, or None for no slowdowns.

    Raises:
        ValueError: A window naming a node outside the run, ending before it starts, with a factor below 1, or
            overlapping another window of its node.
        TypeError: A spec of the wrong kind.
    """
    if slowdowns is None:
        return None
    if isinstance(slowdowns, RandomSlowdowns):
        return SlowdownSchedule(num_nodes, drawn=slowdowns)
    if isinstance(slowdowns, (str, bytes)) or not isinstance(slowdowns, Sequence):
        raise TypeError(f"slowdowns must be a list of (node, from_s, to_s, factor) or RandomSlowdowns(rate, factor, "
                        f"duration, seed), got {slowdowns!r}")
    per_node: list[list[Slowdown]] = [[] for _ in range(num_nodes)]
    for item in slowdowns:
        if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 4:
            raise TypeError(f"each slowdown must be (node, from_s, to_s, factor), got {item!r}")
        node, from_s, to_s, factor = item
        check_int("slowdown node", node, minimum=0)
        if node >= num_nodes:
            raise ValueError(f"slowdown {item!r} names node {node}, but there are only {num_nodes} nodes "
                             f"(0..{num_nodes - 1})")
        check_number("slowdown from_s", from_s, minimum=0.0, finite=True)
        check_number("slowdown to_s", to_s, finite=True)
        if not to_s > from_s:
            raise ValueError(f"slowdown {item!r} must end after it starts (to_s > from_s)")
        check_number("slowdown factor", factor, minimum=1.0, finite=True)
        per_node[node].append(Slowdown(node, float(from_s), float(to_s), float(factor)))
    for node, windows in enumerate(per_node):
        windows.sort(key=lambda w: w.from_s)
        for a, b in zip(windows, windows[1:]):
            if b.from_s < a.to_s:
                raise ValueError(f"slowdowns of node {node} overlap: ({a.from_s}, {a.to_s}) and ({b.from_s}, "
                                 f"{b.to_s}); give one window per span of time")
    return SlowdownSchedule(num_nodes, given=per_node)

