"""Transfers in flight as flows that share their links max-min fairly (a fluid network, as SimGrid's flow model).

Every transfer (a message, a collective) is a flow of `route.nbytes` bytes over its route's directed links
(exogym.cluster.network.Route). At any moment the flows' rates are the max-min fair allocation of the links'
capacities (progressive filling: raise every flow's rate together; when a link is full, the flows crossing it
keep the rate they have; go on with the rest). The rates change only when a flow starts or ends, so the owner of
the event queue asks `start` and `finish` at those moments, in simulated-time order, and gets back the flows
whose finish time moved: their earlier finish events are stale (each flow counts its `version`).

Exactness: a flow that ran at its route's bandwidth alone (the least capacity on it) all its life arrives at
start + route.seconds, the formula's own expression (exogym.cluster.network), so one transfer at a time gives
today's times to the bit. A flow that ever ran slower is integrated: its bytes left at each change of rate, its
last byte at the time they run out, and it arrives its route's latency after that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

from exogym.cluster.network import Route

__all__ = ["Flow", "FlowModel", "max_min_rates"]


@dataclass(eq=False)
class Flow:
    """One transfer in flight.

    Args:
        key: The owner's name for it (unique among the flows in flight).
        route: Its links and bytes.
        start: When it started.
        solo: Its rate alone: its route's least capacity (inf without a finite link).
        rate: Its rate now (bytes/s).
        remaining: Bytes still to send at `since`.
        since: When `rate` began.
        finish: When its last byte leaves, at `rate`.
        shared: Whether it ever ran below `solo`.
        version: How often its finish time moved (finish events carry it; an older one is stale).
    """

    key: Hashable
    route: Route
    start: float
    solo: float
    rate: float
    remaining: float
    since: float
    finish: float
    shared: bool = False
    version: int = 0

    @property
    def arrival(self) -> float:
        """When the transfer is complete at the other end: its last byte plus the route's latency."""
        if not self.shared:
            return self.start + self.route.seconds  # the formula's expression, to the bit
        return self.finish + self.route.latency


def max_min_rates(flows: Iterable[Flow]) -> dict[Flow, float]:
    """The max-min fair rates of `flows` on their links (progressive filling).

    Args:
        flows: The flows in flight.

    Returns:
        Each flow's rate in bytes/s (inf for a flow with no finite link).
    """
    left: dict[str, float] = {}
    crossing: dict[str, list[Flow]] = {}
    rates: dict[Flow, float] = {}
    for f in flows:
        if not f.route.links:
            rates[f] = math.inf
        for link, cap in zip(f.route.links, f.route.capacities):
            left[link] = cap
            crossing.setdefault(link, []).append(f)
    unfrozen = {link: len(fs) for link, fs in crossing.items()}
    while unfrozen:
        # The fullest link: the least capacity left per flow still rising (ties: the first name, for determinism).
        share, link = min((left[l] / n, l) for l, n in unfrozen.items())
        for f in crossing[link]:
            if f in rates:
                continue
            rates[f] = share
            for l in f.route.links:
                left[l] = max(left[l] - share, 0.0)
                unfrozen[l] -= 1
                if not unfrozen[l]:
                    del unfrozen[l]
    return rates


class FlowModel:
    """The flows in flight and the links' use; asked at each flow's start and end, in time order.

    `links` maps each directed link a flow crossed to {"busy_s": seconds it carried at least one flow, "bytes": what
    the flows put on it}, kept up to date in place (a record may hold it while the run goes on).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.flows: dict[Hashable, Flow] = {}
        self.links: dict[str, dict[str, float]] = {}
        self._on: dict[str, int] = {}  # link -> flows in flight crossing it
        self._busy_since: dict[str, float] = {}

    def start(self, key: Hashable, route: Route, at: float) -> list[Flow]:
        """A transfer starts at `at` (not before the last start or end asked; an earlier one starts then).

        Args:
            key: Its name (unique among the flows in flight).
            route: Its route.
            at: When it starts.

        Returns:
            The flows whose finish time is new: this one, and any it slowed.

        Raises:
            ValueError: A flow of this key is in flight.
        """
        if key in self.flows:
            raise ValueError(f"a flow {key!r} is already in flight")
        self.now = now = max(self.now, at)
        solo = min(route.capacities, default=math.inf)
        seconds = route.nbytes / solo if route.nbytes and math.isfinite(solo) else 0.0
        # started late (now > at): its time is integrated from now, no longer the formula's own
        flow = Flow(key, route, at, solo, solo, float(route.nbytes), now, now + seconds, shared=now > at)
        alone = all(not self._on.get(link) for link in route.links)
        self.flows[key] = flow
        for link in route.links:
            use = self.links.get(link)
            if use is None:
                use = self.links[link] = {"busy_s": 0.0, "bytes": 0}
            if not self._on.get(link):
                self._busy_since[link] = now
            use["bytes"] += route.nbytes
            self._on[link] = self._on.get(link, 0) + 1
        if alone:  # nothing else crosses its links: every other rate stands
            return [flow]
        return self._rerate(new=flow)

    def finish(self, key: Hashable) -> tuple[Flow, list[Flow]]:
        """The flow `key` sends its last byte (at its `finish`, the earliest of the flows in flight).

        Args:
            key: The flow.

        Returns:
            The flow, and the flows whose finish time moved as its links freed.
        """
        flow = self.flows.pop(key)
        self.now = max(self.now, flow.finish)
        shared = False
        for link in flow.route.links:
            self._on[link] -= 1
            if self._on[link]:
                shared = True
            else:
                self.links[link]["busy_s"] += self.now - self._busy_since[link]
        return flow, (self._rerate() if shared else [])

    def _rerate(self, new: Flow | None = None) -> list[Flow]:
        now, changed = self.now, []
        for f, rate in max_min_rates(self.flows.values()).items():
            if f is new:
                if rate < f.solo:
                    f.shared = True
                    f.rate, f.since = rate, now
                    f.finish = now + f.remaining / rate if f.remaining else now
                changed.append(f)
                continue
            if rate == f.rate:
                continue
            f.remaining = max(f.remaining - f.rate * (now - f.since), 0.0) if math.isfinite(f.rate) else 0.0
            f.rate, f.since, f.version = rate, now, f.version + 1
            f.shared = f.shared or rate < f.solo
            f.finish = now + f.remaining / rate if f.remaining and rate > 0 else (now if not f.remaining
                                                                                 else math.inf)
            changed.append(f)
        return changed

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The flows in flight and the links' use, as plain data."""
        return {"now": self.now,
                "flows": [{"key": f.key, "route": _route_plain(f.route), "start": f.start, "solo": f.solo,
                           "rate": f.rate, "remaining": f.remaining, "since": f.since, "finish": f.finish,
                           "shared": f.shared, "version": f.version} for f in self.flows.values()],
                "links": {name: dict(use) for name, use in self.links.items()}, "busy_since": dict(self._busy_since)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned."""
        self.now = state["now"]
        self.flows, self._on = {}, {}
        for d in state["flows"]:
            key = tuple(d["key"]) if isinstance(d["key"], list) else d["key"]
            f = Flow(key, Route(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["route"].items()}),
                     d["start"], d["solo"], d["rate"], d["remaining"], d["since"], d["finish"], d["shared"],
                     d["version"])
            self.flows[key] = f
            for link in f.route.links:
                self._on[link] = self._on.get(link, 0) + 1
        self.links.clear()  # in place: a record may hold it
        self.links.update({name: dict(use) for name, use in state["links"].items()})
        self._busy_since = dict(state["busy_since"])


def _route_plain(route: Route) -> dict[str, Any]:
    return {"links": list(route.links), "capacities": list(route.capacities), "nbytes": route.nbytes,
            "latency": route.latency, "seconds": route.seconds}

