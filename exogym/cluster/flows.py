"""Transfers in flight as flows that share their links max-min fairly (a fluid network, as SimGrid's flow model).

Every transfer (a message, a collective) is a flow of `route.nbytes` bytes over its route's directed links
(exogym.cluster.network.Route). At any moment the flows' rates are the max-min fair allocation of the links'
capacities (progressive filling: raise every flow's rate together; when a link is full, the flows crossing it
keep the rate they have; go on with the rest). The rates change only when a flow starts or ends, so the owner of
the event queue asks `start` and `finish` at those moments, in simulated-time order, and after each asks for the
`next_finish`: the flow whose last byte leaves first (ties: the one started first). It keeps one event for it; a
start or an end moves the model's `version`, which makes that event stale (one event in flight, not one per flow:
re-rating F flows pushes nothing F times).

Exactness: a flow that ran at its route's bandwidth alone (the least capacity on it) all its life arrives at
start + route.seconds, the formula's own expression (exogym.cluster.network), so one transfer at a time gives
today's times to the bit. A flow that ever ran slower is integrated: its bytes left at each change of rate, its
last byte at the time they run out, and it arrives its route's latency after that.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

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
    # The fullest link next: the least capacity left per flow still rising (ties: the first name, for determinism).
    # A link's share only grows as flows on it freeze (each takes at most the share), so a heap with the stale
    # entries re-pushed at their new share gives the least one.
    heap = [(left[link] / n, link) for link, n in unfrozen.items()]
    heapq.heapify(heap)
    while heap:
        share, link = heapq.heappop(heap)
        n = unfrozen.get(link)
        if not n:
            continue
        if left[link] / n != share:
            heapq.heappush(heap, (left[link] / n, link))
            continue
        for f in crossing[link]:
            if f in rates:
                continue
            rates[f] = share
            for l in f.route.links:
                rest = left[l] - share
                left[l] = max(0.0, rest)
                unfrozen[l] -= 1
    return rates


class FlowModel:
    """The flows in flight and the links' use; asked at each flow's start and end, in time order.

    `links` maps each directed link a flow crossed to {"busy_s": seconds it carried at least one flow, "bytes": what
    the flows put on it}, kept up to date in place (a record may hold it while the run goes on). `spans` maps the same
    links to their busy time as a timeline lane (exogym.runs.timeline): {"t": boundaries from 0, "kinds": one letter a
    span ("b" busy: at least one flow crossed it, "i" idle), "flows": the most flows on it at once in each span};
    a busy period starting when the last one ended continues it, so a link carrying back-to-back flows is one span.
    A busy period is written when it ends (the lane is complete once every flow has ended).
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.version = 0  # moves at every start and end: a finish event of an older version is stale
        self.flows: dict[Hashable, Flow] = {}
        self.links: dict[str, dict[str, float]] = {}
        self._on: dict[str, int] = {}  # link -> flows in flight crossing it
        self._busy_since: dict[str, float] = {}
        self.spans: dict[str, dict[str, Any]] = {}
        self._peak: dict[str, int] = {}  # link -> the most flows on it at once since it became busy

    def start(self, key: Hashable, route: Route, at: float) -> Flow:
        """A transfer starts at `at` (not before the last start or end asked; an earlier one starts then).

        Args:
            key: Its name (unique among the flows in flight).
            route: Its route.
            at: When it starts.

        Returns:
            The flow.

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
        self.version += 1
        for link in route.links:
            use = self.links.get(link)
            if use is None:
                use = self.links[link] = {"busy_s": 0.0, "bytes": 0}
            if not self._on.get(link):
                self._busy_since[link], self._peak[link] = now, 0
            use["bytes"] += route.nbytes
            self._on[link] = self._on.get(link, 0) + 1
            self._peak[link] = max(self._peak[link], self._on[link])
        if not alone:  # something else crosses its links: re-rate (else every other rate stands)
            self._rerate(new=flow)
        return flow

    def next_finish(self) -> Flow | None:
        """The flow in flight whose last byte leaves first (ties: the one started first), or None."""
        return min(self.flows.values(), key=lambda f: f.finish, default=None)

    def finish(self, key: Hashable) -> Flow:
        """The flow `key` sends its last byte (at its `finish`: the `next_finish`).

        Args:
            key: The flow.

        Returns:
            The flow, gone from the flows in flight (its `arrival` says when it is complete at the other end).
        """
        flow = self.flows.pop(key)
        self.now = max(self.now, flow.finish)
        self.version += 1
        shared = False
        for link in flow.route.links:
            self._on[link] -= 1
            if self._on[link]:
                shared = True
            else:
                self.links[link]["busy_s"] += self.now - self._busy_since[link]
                self._log_busy(link, self._busy_since[link], self.now, self._peak.pop(link))
        if shared:
            self._rerate()
        return flow

    def _log_busy(self, link: str, since: float, until: float, flows: int) -> None:
        """The link's lane gets its busy period [since, until] with at most `flows` flows at once."""
        lane = self.spans.setdefault(link, {"t": [0.0], "kinds": "", "flows": []})
        t = lane["t"]
        if lane["kinds"].endswith("b") and t[-1] == since:  # back to back with the last one: one span
            t[-1] = until
            lane["flows"][-1] = max(lane["flows"][-1], flows)
            return
        if not until > since:
            return  # nothing crossed it for any time (a transfer of no bytes)
        if since > t[-1]:
            t.append(since)
            lane["kinds"] += "i"
            lane["flows"].append(0)
        t.append(until)
        lane["kinds"] += "b"
        lane["flows"].append(flows)

    def _rerate(self, new: Flow | None = None) -> None:
        now = self.now
        for f, rate in max_min_rates(self.flows.values()).items():
            if rate == f.rate:  # (a new flow starts at its solo rate: unchanged when it gets it)
                continue
            if f is not new:
                f.remaining = max(f.remaining - f.rate * (now - f.since), 0.0) if math.isfinite(f.rate) else 0.0
            f.rate, f.since = rate, now
            f.shared = f.shared or rate < f.solo
            f.finish = now + f.remaining / rate if f.remaining and rate > 0 else (now if not f.remaining
                                                                                 else math.inf)

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The flows in flight and the links' use, as plain data.

        Returns:
            The state, for load_state_dict.
        """
        return {"now": self.now, "version": self.version,
                "flows": [{"key": f.key, "route": _route_plain(f.route), "start": f.start, "solo": f.solo,
                           "rate": f.rate, "remaining": f.remaining, "since": f.since, "finish": f.finish,
                           "shared": f.shared} for f in self.flows.values()],
                "links": {name: dict(use) for name, use in self.links.items()}, "busy_since": dict(self._busy_since),
                "spans": {name: _lane_copy(lane) for name, lane in self.spans.items()}, "peak": dict(self._peak)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned.

        Args:
            state: What state_dict returned.
        """
        self.now, self.version = state["now"], state["version"]
        self.flows, self._on = {}, {}
        for d in state["flows"]:
            key = tuple(d["key"]) if isinstance(d["key"], list) else d["key"]
            f = Flow(key, Route(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["route"].items()}),
                     d["start"], d["solo"], d["rate"], d["remaining"], d["since"], d["finish"], d["shared"])
            self.flows[key] = f
            for link in f.route.links:
                self._on[link] = self._on.get(link, 0) + 1
        self.links.clear()  # in place: a record may hold it
        self.links.update({name: dict(use) for name, use in state["links"].items()})
        self._busy_since = dict(state["busy_since"])
        self.spans.clear()  # in place, as links
        self.spans.update({name: _lane_copy(lane) for name, lane in state.get("spans", {}).items()})
        self._peak = dict(state.get("peak", {}))


def _lane_copy(lane: dict[str, Any]) -> dict[str, Any]:
    return {"t": list(lane["t"]), "kinds": lane["kinds"], "flows": list(lane["flows"])}


def _route_plain(route: Route) -> dict[str, Any]:
    return {"links": list(route.links), "capacities": list(route.capacities), "nbytes": route.nbytes,
            "latency": route.latency, "seconds": route.seconds}

