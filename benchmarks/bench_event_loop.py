"""The engine's cost against a plain event loop: asynchronous DiLoCo through exogym against the same work with no
framework at all.

The anchor (`plain_event_loop`, about 40 lines): K copies of the MLP 784-256-256-10 (benchmarks/workload.py),
AdamW each, batches of 32 MNIST-shaped examples gathered from each node's shuffled shard; node i's inner step takes
1 / speed_i simulated seconds; the node whose clock is earliest goes next (a heap); every H steps it sends
theta_start - theta_node to a server that applies it at once (outer Nesterov SGD, lr 0.7, momentum 0.9, as
AsyncDiLoCoStrategy's defaults) and continues from the server's theta. No messages,
no network, no records: the arithmetic the simulation cannot avoid, and the least bookkeeping that orders it.
Against it: `AsyncDiLoCoStrategy(H)` through `Trainer.fit` with the same K, speeds, model, optimizer and data
(no network model, no validation, no logger). Printed: wall milliseconds per inner step (node-step) of each,
interleaved in one process, the fastest of --repeat, and the ratio, with the machine's load average; --cpu-time:
the process's CPU seconds instead of wall seconds (what other load on a shared machine moves least).
Usage: python benchmarks/bench_event_loop.py [--nodes 16] [--steps 100] [--H 10] [--repeat 3] [--cpu-time]
"""

from __future__ import annotations

import argparse
import copy
import heapq
import os
import time

import torch

from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
from workload import MLP, make_data

BATCH = 32
CLOCK = time.perf_counter  # --cpu-time: time.process_time


def plain_event_loop(k: int, steps: int, H: int, speeds: list[float]) -> float:
    """Wall seconds per node-step of the anchor (module docstring)."""
    torch.manual_seed(0)
    model, data = MLP(), make_data(k * BATCH * 4)
    nodes = [copy.deepcopy(model) for _ in range(k)]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in nodes]
    params = [list(m.parameters()) for m in nodes]
    theta = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    momentum = torch.zeros_like(theta)
    starts = [theta.clone() for _ in range(k)]
    shard = len(data) // k
    xs, ys = data.tensors
    order = [r * shard + torch.randperm(shard) for r in range(k)]  # each node's shard, shuffled (one epoch's order)
    done = [0] * k
    events = [(0.0, r) for r in range(k)]  # (clock, rank): the earliest finisher goes next
    start = CLOCK()
    while events:
        clock, r = heapq.heappop(events)
        i = (done[r] * BATCH) % shard
        idx = order[r][i:i + BATCH]  # a gathered batch, as a sampler gives it
        loss = torch.nn.functional.cross_entropy(nodes[r].net(xs[idx]), ys[idx])
        optims[r].zero_grad()
        loss.backward()
        optims[r].step()
        done[r] += 1
        if done[r] % H == 0 or done[r] == steps:  # the round's pseudo-gradient to the server, theta back
            with torch.no_grad():
                g = starts[r] - torch.nn.utils.parameters_to_vector(params[r])
                momentum.mul_(0.9).add_(g)
                theta.sub_(g + 0.9 * momentum, alpha=0.7)
                torch.nn.utils.vector_to_parameters(theta, params[r])
                starts[r] = theta.clone()
        if done[r] < steps:
            heapq.heappush(events, (clock + 1.0 / speeds[r], r))
    return (CLOCK() - start) / (k * steps)


def exogym_run(k: int, steps: int, H: int, speeds: list[float]) -> float:
    """Wall seconds per node-step of AsyncDiLoCoStrategy on the same work."""
    torch.manual_seed(0)
    trainer = Trainer(MLP(), make_data(k * BATCH * 4))
    start = CLOCK()
    trainer.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=1e-3), H=H), k, max_steps=steps,
                batch_size=BATCH, node_speeds=speeds, device="cpu", logger=False, progress=False)
    return (CLOCK() - start) / (k * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true", help="CPU seconds of this process instead of wall seconds")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    k = args.nodes
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]
    runs = {"plain event loop": plain_event_loop, "exogym async DiLoCo": exogym_run}
    best = {name: float("inf") for name in runs}
    load = os.getloadavg()[0]
    for fn in runs.values():  # warm-up
        fn(k, args.H, args.H, speeds)
    for _ in range(args.repeat):
        for name, fn in runs.items():
            best[name] = min(best[name], fn(k, args.steps, args.H, speeds))
    load = max(load, os.getloadavg()[0])
    print(f"K={k}, {args.steps} steps, H={args.H}, MLP 784-256-256-10, batch 32, AdamW, one thread, "
          f"{'CPU' if args.cpu_time else 'wall'} time, {os.cpu_count()} cores, load average (1 min, highest seen) "
          f"{load:.1f}\n")
    print("| run | ms per node-step | vs plain event loop |\n|---|---|---|")
    for name in runs:
        print(f"| {name} | {best[name] * 1e3:.3f} | {best[name] / best['plain event loop']:.3f}x |")


if __name__ == "__main__":
    main()
