"""The flow model's cost: max-min fair sharing (exogym.cluster.flows) with many transfers in flight at once.

Each scenario starts F uploads to one server and runs them to their ends in time order, as the sim's post office
does (one finish event in the heap, for the flow that ends first; stale once a flow started or ended since). Every start and every end
re-rates the flows that share a link with it. Printed per scenario: the flows, the events handled (starts, ends and
stale finish events skipped), wall seconds, microseconds per event, and the ratio to the same uploads one at a time
(each alone on its links: no re-rating, the formula's time), measured side by side in one run (the best of
--repeat), with the machine's load average.

Scenarios: "at once": F uploads start together over a shared server link (every end re-rates all the others);
"staggered": F uploads start 1 ms apart, each node capped by its own access link (1 to 10 Gbit/s), so flows
capped elsewhere leave the server link's rest to the others (progressive filling runs several rounds).
Usage: python benchmarks/bench_flows.py [--flows 64 256 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import random
import time

from exogym.cluster.flows import FlowModel
from exogym.cluster.network import SERVER, Network

MB = 1_000_000


def drive(starts) -> tuple[int, FlowModel]:
    """Run `starts` ([(at, key, route)], sorted by time) to their ends; the events handled."""
    model, events, order, handled = FlowModel(), [], itertools.count(), 0
    pending = list(starts)
    i = 0

    def schedule():
        flow = model.next_finish()
        if flow is not None:
            heapq.heappush(events, (flow.finish, next(order), flow.key, model.version))

    while i < len(pending) or events:
        handled += 1
        if i < len(pending) and (not events or pending[i][0] < events[0][0]):
            at, key, route = pending[i]
            i += 1
            model.start(key, route, at)
            schedule()
            continue
        _, _, key, version = heapq.heappop(events)
        if version != model.version:
            continue
        model.finish(key)
        schedule()
    return handled, model


def scenario(name: str, flows: int) -> tuple[list, list]:
    """The uploads of a scenario, and the same uploads one after another (each alone)."""
    rng = random.Random(0)
    if name == "at once":
        net = Network(bandwidth="10Gbps", latency="5ms")
        shared = [(0.0, r, net.message_route(100 * MB, r, SERVER)) for r in range(flows)]
    else:
        net = Network(bandwidth="100Gbps", latency="5ms", server_bandwidth="10Gbps",
                      node_upload=[f"{rng.uniform(1, 10):.3f}Gbps" for _ in range(flows)])
        shared = [(0.001 * r, r, net.message_route(100 * MB, r, SERVER)) for r in range(flows)]
    alone, t = [], 0.0
    for _, key, route in shared:
        alone.append((t, key, route))
        t += route.seconds * 2
    return shared, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flows", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the start")
    print("| scenario | flows | events | wall s | us per event | one at a time: wall s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for name in ("at once", "staggered"):
        for flows in args.flows:
            shared, alone = scenario(name, flows)
            best = {"shared": float("inf"), "alone": float("inf")}
            for _ in range(args.repeat):
                for kind, starts in (("shared", shared), ("alone", alone)):
                    t0 = time.perf_counter()
                    events, model = drive(starts)
                    best[kind] = min(best[kind], time.perf_counter() - t0)
                    if kind == "shared":
                        handled = events
                    assert not model.flows
            print(f"| {name} | {flows} | {handled} | {best['shared']:.3f} | {1e6 * best['shared'] / handled:.1f} | "
                  f"{best['alone']:.4f} | {best['shared'] / best['alone']:.0f}x |")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")


if __name__ == "__main__":
    main()
