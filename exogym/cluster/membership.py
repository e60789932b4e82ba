"""Which nodes are up at each step: failure schedules and elastic compute pools.

A node that is down computes nothing and sends nothing; the collectives of the nodes that are up run
without it (`exogym.comm.collectives.alive_ranks()` says who is up), and the averaging strategies
average over them. When nodes come up, a node that was already up hands them the global state
(`exogym.engine.rejoin`). Steps count from 1, as in the record.

The schedules, as `fit` takes them:

- `failures`: a list of `(node, step_down, step_up)`, the node being down for steps
  `step_down <= t < step_up` (`step_up` None: it never comes back); or `RandomFailures(rate, downtime, seed)`.
- `active_nodes` (elastic compute): the size of the pool at each step; ranks `0..n-1` are in it. A preset of
  the DiLoCo paper's compute pools (`"doubling"`: K/2 then K; `"halving"`: K then K/2; `"ramp_up"`: 1 up to
  K in K equal phases; `"ramp_down"`: K down to 1), a list of `(from_step, count)`, or a callable
  `step -> count`.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from exogym._validation import check_int, check_number

__all__ = ["Membership", "RandomFailures", "ELASTIC_PRESETS", "build_membership"]

ELASTIC_PRESETS = ("doubling", "halving", "ramp_up", "ramp_down")


@dataclass(frozen=True)
class RandomFailures:
    """Random node failures for `fit(failures=...)`: each node up fails at each step with probability `rate`.

    A node that fails stays down for `downtime` steps. A failure that would leave no node up from the step
    before is skipped (someone must hold the model).

    Args:
        rate: The probability, per node and step, in [0, 1].
        downtime: Steps a failed node stays down (at least 1).
        seed: The seed of the failures' random stream.

    Raises:
        ValueError: A value out of range.
    """

    rate: float
    downtime: int = 10
    seed: int = 0

    def __post_init__(self):
        check_number("RandomFailures rate", self.rate, minimum=0.0, maximum=1.0)
        check_int("RandomFailures downtime", self.downtime, minimum=1)
        check_int("RandomFailures seed", self.seed, minimum=0)


@dataclass(frozen=True)
class Membership:
    """The nodes up at every step, stored as the steps where that set changes.

    Args:
        num_nodes: The run's node count.
        starts: The first step of each stretch, ascending, `starts[0] == 1`.
        members: The sorted ranks up during each stretch.
    """

    num_nodes: int
    starts: tuple[int, ...]  # the first step of each stretch, ascending, starts[0] == 1
    members: tuple[tuple[int, ...], ...]  # the sorted ranks up during each stretch

    def alive(self, step: int) -> tuple[int, ...]:
        """The nodes up at `step`.

        Args:
            step: The step, counted from 1.

        Returns:
            The ranks, sorted.
        """
        return self.members[bisect.bisect_right(self.starts, step) - 1]

    def up_from(self, step: int) -> frozenset[int]:
        """The nodes up at `step` or at any step after it: a node not among them is gone for good.

        Args:
            step: The step, counted from 1.

        Returns:
            The ranks.
        """
        return self._up_from_stretch[max(0, bisect.bisect_right(self.starts, step) - 1)]

    @functools.cached_property
    def _up_from_stretch(self) -> tuple[frozenset[int], ...]:
        """Per stretch, the nodes up in it or in any later one (built once, from the last stretch back)."""
        out, seen = [], frozenset()
        for members in reversed(self.members):
            seen = seen | frozenset(members)
            out.append(seen)
        return tuple(reversed(out))

    def joiners(self, step: int) -> tuple[int, ...]:
        """Nodes up at `step` that were down at the step before.

        At step 1 there are none: every node starts from the initial model.

        Args:
            step: The step, counted from 1.

        Returns:
            The ranks, sorted.
        """
        i = bisect.bisect_right(self.starts, step) - 1  # asked every step: a search, not a scan of starts
        if step <= 1 or self.starts[i] != step:
            return ()
        before = set(self.members[i - 1])
        return tuple(r for r in self.members[i] if r not in before)

    def survivors(self, step: int) -> tuple[int, ...]:
        """Nodes up at `step` and at the step before.

        Args:
            step: The step, counted from 1.

        Returns:
            The ranks, sorted.
        """
        before = set(self.alive(step - 1)) if step > 1 else set(self.alive(step))
        return tuple(r for r in self.alive(step) if r in before)

    def as_record(self) -> list[dict[str, Any]]:
        """The schedule as plain data for the run's config: `[{"from_step", "nodes_up"}, ...]`.

        Returns:
            One dict per stretch.
        """
        return [{"from_step": s, "nodes_up": list(m)} for s, m in zip(self.starts, self.members)]


def build_membership(num_nodes: int, max_steps: int, failures: Any = None,
                     active_nodes: Any = None) -> Membership | None:
    """Validate the schedules and combine them.

    Args:
        num_nodes: The run's node count.
        max_steps: The run's length in steps.
        failures: fit's `failures` (see the module's description).
        active_nodes: fit's `active_nodes` (see the module's description).

    Returns:
        The Membership, or None when every node is up at every step.

    Raises:
        ValueError: A schedule that names a node or step outside the run, or leaves no node up.
        TypeError: A schedule of the wrong kind.
    """
    if failures is None and active_nodes is None:
        return None
    down = _failure_intervals(failures, num_nodes, max_steps) if not isinstance(failures, RandomFailures) else None
    pool = _pool_sizes(active_nodes, num_nodes, max_steps)
    starts: list[int] = []
    members: list[tuple[int, ...]] = []
    rng = np.random.default_rng(failures.seed) if isinstance(failures, RandomFailures) else None
    down_until = [0] * num_nodes  # random failures: the node is down while step < down_until
    previous: tuple[int, ...] = ()
    for step in range(1, max_steps + 1):
        in_pool = range(pool(step)) if pool is not None else range(num_nodes)
        if rng is not None:
            up = [r for r in in_pool if step >= down_until[r]]
            fails = rng.random(num_nodes) < failures.rate  # one draw per node: the stream ignores the pool
            was_up = set(previous) if step > 1 else set(up)
            for r in [r for r in up if fails[r]]:
                if any(q != r and q in was_up for q in up):  # someone who held the model stays up
                    down_until[r] = step + failures.downtime
                    up.remove(r)
            alive = tuple(up)
        else:
            alive = tuple(r for r in in_pool if not any(a <= step < b for a, b in down[r]))
        if not alive:
            raise ValueError(f"no node is up at step {step} (failures={failures!r}, active_nodes={active_nodes!r}); "
                             "at least one node must be up at every step")
        if step > 1 and alive != previous and not set(alive) & set(previous):
            raise ValueError(f"at step {step} nodes {list(alive)} come up while every node up at step {step - 1} "
                             f"({list(previous)}) goes down: no node is left to hand them the model")
        if alive != previous:
            starts.append(step)
            members.append(alive)
        previous = alive
    return Membership(num_nodes, tuple(starts), tuple(members))


def _failure_intervals(failures: Any, num_nodes: int, max_steps: int) -> list[list[tuple[int, float]]]:
    """Per node, its [step_down, step_up) intervals, checked."""
    down: list[list[tuple[int, float]]] = [[] for _ in range(num_nodes)]
    if failures is None:
        return down
    if isinstance(failures, (str, bytes)) or not isinstance(failures, Sequence):
        raise TypeError(f"failures must be a list of (node, step_down, step_up) or RandomFailures(rate, downtime, "
                        f"seed), got {failures!r}")
    for item in failures:
        if not isinstance(item, Sequence) or len(item) != 3:
            raise TypeError(f"each failure must be (node, step_down, step_up), with step_up None for a node that "
                            f"never comes back; got {item!r}")
        node, step_down, step_up = item
        check_int("failure node", node, minimum=0)
        if node >= num_nodes:
            raise ValueError(f"failure {item!r} names node {node}, but there are only {num_nodes} nodes "
                             f"(0..{num_nodes - 1})")
        check_int("failure step_down", step_down, minimum=1)
        if step_down > max_steps:
            raise ValueError(f"failure {item!r} starts at step {step_down}, after the run's last step {max_steps}")
        check_int("failure step_up", step_up, minimum=step_down + 1, allow_none=True)
        end = float("inf") if step_up is None else step_up
        if any(a < end and step_down < b for a, b in down[node]):
            raise ValueError(f"failure {item!r} overlaps another failure of node {node}: {down[node]}")
        down[node].append((step_down, end))
    return down


def _pool_sizes(active_nodes: Any, num_nodes: int, max_steps: int) -> Callable[[int], int] | None:
    """active_nodes as a checked function step -> pool size."""
    if active_nodes is None:
        return None
    if isinstance(active_nodes, str):
        if active_nodes not in ELASTIC_PRESETS:
            raise ValueError(f"active_nodes must be one of {list(ELASTIC_PRESETS)}, a list of (from_step, count), or "
                             f"a callable step -> count; got {active_nodes!r}")
        if active_nodes in ("doubling", "halving") and num_nodes < 2:
            raise ValueError(f"active_nodes={active_nodes!r} needs num_nodes >= 2, got {num_nodes}")
        half, k = max(1, num_nodes // 2), num_nodes
        presets: dict[str, Callable[[int], int]] = {
            "doubling": lambda t: half if 2 * (t - 1) < max_steps else k,
            "halving": lambda t: k if 2 * (t - 1) < max_steps else half,
            "ramp_up": lambda t: 1 + (t - 1) * k // max_steps,
            "ramp_down": lambda t: k - (t - 1) * k // max_steps,
        }
        return presets[active_nodes]
    if callable(active_nodes):
        fn = active_nodes
    elif isinstance(active_nodes, Sequence) and active_nodes:
        points = []
        for item in active_nodes:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise TypeError(f"active_nodes entries must be (from_step, count), got {item!r}")
            check_int("active_nodes from_step", item[0], minimum=1)
            check_int("active_nodes count", item[1], minimum=1)
            points.append((item[0], item[1]))
        if points[0][0] != 1 or any(a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise ValueError(f"active_nodes must start at step 1 with strictly increasing steps, got {active_nodes!r}")
        steps = [s for s, _ in points]
        fn = lambda t: points[bisect.bisect_right(steps, t) - 1][1]  # noqa: E731
    else:
        raise TypeError(f"active_nodes must be one of {list(ELASTIC_PRESETS)}, a non-empty list of (from_step, count), "
                        f"or a callable step -> count; got {active_nodes!r}")

    def checked(step: int) -> int:
        n = fn(step)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= num_nodes:
            raise ValueError(f"active_nodes gives {n!r} nodes at step {step}; it must be an int in 1..{num_nodes}")
        return int(n)
    return checked
