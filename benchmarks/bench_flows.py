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
With --run: what sharing costs a training run: asynchronous DiLoCo, K = 16 nodes of the MLP 784-256-256-10
(benchmarks/workload.py), H = 10, the "home" network and bench_async's node speeds, wall seconds per node-step with
the links shared against `shared_links=False`, the runs interleaved, the fastest of --repeat each.
Usage: python benchmarks/bench_flows.py [--flows 64 256 1024] [--repeat 3] [--run [--nodes 16] [--steps 100]]
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


def run_cost(args: argparse.Namespace) -> None:
    """Asynchronous DiLoCo's wall seconds per node-step, links shared against each transfer alone."""
    import torch

    from exogym import Trainer
    from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
    from workload import MLP, make_data

    torch.set_num_threads(1)
    k = args.nodes
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]

    def one(shared: bool) -> float:
        torch.manual_seed(0)
        trainer = Trainer(MLP(), make_data(k * 32 * 4))
        start = time.perf_counter()
        trainer.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=1e-3), H=10), k, max_steps=args.steps,
                    batch_size=32, network=Network.preset("home", shared_links=shared), node_speeds=speeds,
                    device="cpu", logger=False, progress=False)
        return (time.perf_counter() - start) / (k * args.steps)

    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the start")
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.repeat):
        for shared in (False, True):
            best[shared] = min(best[shared], one(shared))
    print("| async DiLoCo | ms per node-step, per transfer | ms per node-step, shared | ratio |")
    print("|---|---|---|---|")
    print(f"| K={k}, {args.steps} steps | {1e3 * best[False]:.3f} | {1e3 * best[True]:.3f} | "
          f"{best[True] / best[False]:.3f}x |")
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flows", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--run", action="store_true", help="the cost in a training run instead (module doc)")
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if args.run:
        run_cost(args)
        return
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
