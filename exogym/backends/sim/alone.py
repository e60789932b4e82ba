"""Over several processes a sim collective of a strategy that sends no messages is costed alone, by its formula: the
run has no keeper, and the processes keep no flow model in common. That gives one process's numbers exactly when the collective really was alone on its links there, so each
process checks it, for the collectives it takes part in, and a collective that would have shared a link is an error
(a result that differs from what was asked for): what one process runs as flows sharing the links
(exogym.backends.sim.postoffice) cannot be run over processes yet.

Why a process sees every overlap on a node's port or nic: a collective occupies the port and nic of each of its
members only, so two collectives sharing node i's link both have node i as a member, and node i's process checks
both. Two collectives sharing a link between datacenters may have no process in common; the check sees those only when
they do (docs/processes.md says so). A strategy that sends messages needs no check: over processes its collectives'
transfers are flows of the keeper's, with its messages (exogym.backends.sim.postlink).
"""

from __future__ import annotations

import math
from typing import Callable

from exogym.cluster.network import Route
from exogym.comm.transport import CollectiveError

__all__ = ["AloneCheck"]

_HINT = ("Run it in one process (processes=1), where transfers share the links as flows, or cost every transfer "
         "alone (Network(..., shared_links=False))")


class AloneCheck:
    """The busy spans of the links this process's collectives occupied, kept while a later collective could still
    overlap them.

    Args:
        floor: The least clock among this process's unfinished nodes: no collective they take part in can start
            before it, so spans ending by then are dropped.
    """

    def __init__(self, floor: Callable[[], float]):
        self._floor = floor
        self._busy: dict[str, list[tuple[float, float, str]]] = {}

    def check(self, route: Route, start: float, what: str) -> None:
        """A collective of this process's, on `route` from `start` (its last member's arrival anywhere).

        Args:
            route: Its links and bytes (Network.collective_route).
            start: When its transfer starts.
            what: The collective in words, for the error.

        Raises:
            CollectiveError: it would share a link with another collective of this process's.
        """
        if not route.nbytes or not route.links:
            return
        end = start + route.nbytes / min(route.capacities)  # its last byte, alone (the link is free again then)
        floor = self._floor()
        for link in route.links:
            spans = self._busy.setdefault(link, [])
            spans[:] = [s for s in spans if s[1] > floor]
            for other_start, other_end, other in spans:
                if start < other_end and other_start < end:
                    raise CollectiveError(
                        f"{what} (its transfer from {start:.6g} s to {end:.6g} s) overlaps {other} (from "
                        f"{other_start:.6g} s to {other_end:.6g} s) on {link!r}, in a run over several processes: "
                        "there collectives are costed alone, by their formula, so these two would end earlier than "
                        f"in one process, where they share the link. {_HINT}")
            spans.append((start, end if math.isfinite(end) else start, what))
