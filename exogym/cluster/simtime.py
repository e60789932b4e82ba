"""Simulated time: each node's virtual clock, advanced by its compute and by the collectives it joins.

A node's clock moves forward by the compute time of each step (its FLOPs over its device's
throughput times its speed factor, or the measured wall time over its speed factor), and, at
a collective, every member leaves at max(arrival times) + the network's duration for the op:
the time between its own arrival and the last member's is waiting, the duration is
communication. With async_op=True the node keeps computing while the transfer runs, and only
the part still left when it calls wait() is added (as waiting). The simulated wall-clock of
the run is the latest clock. A transient slowdown (exogym.cluster.slowdowns) stretches the compute that falls in
its window: the extra seconds are the node's slowed time, apart from its compute. Every move of a clock goes through
its methods, which also lay it down as a span of its SpanLog (exogym.cluster.spans), when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from exogym.cluster.flows import Flow
from exogym.cluster.network import Network
from exogym.cluster.slowdowns import SlowdownSchedule
from exogym.cluster.spans import SpanLog

__all__ = ["NodeClock", "TimeModel"]


@dataclass
class NodeClock:
    """One node's simulated seconds, and where they went (slowed_s: compute stretched by transient slowdowns)."""

    now: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wait_s: float = 0.0
    slowed_s: float = 0.0
    spans: SpanLog | None = field(default=None, repr=False, compare=False)  # the timeline, when recorded

    def __post_init__(self) -> None:
        if isinstance(self.spans, dict):  # from a checkpoint, as plain data
            self.spans = SpanLog(**self.spans)

    def _moved(self, kind: str) -> None:
        if self.spans is not None:
            self.spans.advance(kind, self.now)

    def add_compute(self, seconds: float, slowed: float = 0.0) -> None:
        if slowed:  # on the timeline the stretched step is one slowed span (not a compute and a slowed one a step)
            self.now += seconds + slowed
            self.slowed_s += slowed
            self._moved("s")
        else:
            self.now += seconds
            self._moved("c")
        self.compute_s += seconds

    def catch_up(self, done_at: float) -> None:
        """Waiting on an async collective or for a message: the time until it ends, if any is left, is waiting."""
        if done_at > self.now:
            self.wait_s += done_at - self.now
            self.now = done_at
            self._moved("i")

    def transfer_until(self, done_at: float) -> None:
        """A send waited on: the time until the message arrives, if any is left, is communication."""
        if done_at > self.now:
            self.comm_s += done_at - self.now
            self.now = done_at
            self._moved("m")

    def sit_out(self, seconds: float) -> None:
        """A down node's step: its compute time passes idle (as down time on the timeline)."""
        self.now += seconds
        self.wait_s += seconds
        self._moved("i")

    def leave_collective(self, arrival: float, start: float, end: float) -> None:
        """A blocking collective: waiting from arrival to the transfer's start, communicating until its end."""
        self.wait_s += start - arrival
        if self.spans is not None:
            self.spans.advance("i", start)
        self.now = end
        self._moved("m")

    def as_dict(self) -> dict[str, float]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "spans"}  # (asdict would copy the spans)
        if not d["slowed_s"]:  # a run without slowdowns records what it always did
            del d["slowed_s"]
        return d


@dataclass(frozen=True)
class TimeModel:
    """The cluster a run is costed on: the network, each node's speed factor and device throughput, and the
    transient slowdowns (None: none)."""

    network: Network
    node_speeds: tuple[float, ...]
    device_flops: tuple[float, ...]
    measured: bool  # compute time from wall-clock measurement instead of FLOPs
    slowdowns: SlowdownSchedule | None = None

    def compute_seconds(self, rank: int, *, flops: float, measured_s: float) -> float:
        if self.measured:
            return measured_s / self.node_speeds[rank]
        return flops / (self.device_flops[rank] * self.node_speeds[rank])

    def add_compute(self, rank: int, clock: NodeClock, *, flops: float, measured_s: float) -> None:
        """Advance node `rank`'s clock by one step's compute: its seconds at the node's speed, stretched by any
        slowdown whose window it meets (the stretch is the clock's slowed_s)."""
        seconds = self.compute_seconds(rank, flops=flops, measured_s=measured_s)
        if self.slowdowns is None:
            clock.add_compute(seconds)
        else:
            clock.add_compute(seconds, self.slowdowns.stretch(rank, clock.now, seconds) - seconds)

    def settle(self, members: Sequence[tuple[NodeClock, float, bool]], op: str, nbytes: int,
               ranks: Sequence[int]) -> float:
        """Members (clock, arrival time, blocking) of a collective, in `ranks` order: the transfer starts at
        the last arrival and takes the network's duration. Blocking members leave at its end; async ones
        ran on and catch up in `catch_up` when they wait. Returns the time it ends."""
        return self.leave(members, max(arrival for _, arrival, _ in members), op, nbytes, ranks)

    def leave_flow(self, members: Sequence[tuple[NodeClock, float, bool]], start: float, flow: Flow) -> float:
        """`leave` for a collective that ran as a flow on shared links (exogym.cluster.flows: started at `start`
        on `network.collective_route`, now ended): its members leave at the flow's arrival. A flow that ran alone
        all along gives `leave`'s numbers to the bit. Returns the time it ends."""
        duration = flow.route.seconds if not flow.shared else flow.arrival - start
        done = start + duration if not flow.shared else flow.arrival
        for clock, arrival, blocking in members:
            clock.comm_s += duration  # transfer time, waiting for a shared link included
            if blocking:
                clock.leave_collective(arrival, start, done)
        return done

    def leave(self, members: Sequence[tuple[NodeClock, float, bool]], start: float, op: str, nbytes: int,
              ranks: Sequence[int]) -> float:
        """`settle` with the transfer's start given: the last arrival, among members some of which are elsewhere
        (another process's clocks)."""
        duration = self.network.duration(op, nbytes, ranks)
        for clock, arrival, blocking in members:
            clock.comm_s += duration  # transfer time, whether or not compute overlapped it
            if blocking:
                clock.leave_collective(arrival, start, start + duration)
        return start + duration
