"""The event order's cost: asynchronous DiLoCo against synchronous DiLoCo on the same work.

K = 16 nodes of the MLP 784-256-256-10 (benchmarks/workload.py) on MNIST-shaped data, batch 32 per node,
H = 10, AdamW inner, the same steps; a WAN network model and node speeds 1.0 ... 0.25 (so the asynchronous
run's event order is not trivial). Synchronous DiLoCo meets in one all-reduce per round; AsyncDiLoCo sends
each node's pseudo-gradient to the server (a message each way per round, every arrival and observation
through the post office's event queue). Printed: wall seconds per node-step of each, and their ratio, the
runs interleaved in one process (the fastest of --repeat counts).
Usage: python benchmarks/bench_async.py [--nodes 16] [--steps 100] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec
from workload import MLP, make_data


def run(make, k: int, steps: int) -> float:
    torch.manual_seed(0)
    trainer = Trainer(MLP(), make_data(k * 32 * 4))
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]
    start = time.perf_counter()
    trainer.fit(make(), k, max_steps=steps, batch_size=32, network="home", node_speeds=speeds, device="cpu",
                logger=False, progress=False)
    return (time.perf_counter() - start) / (k * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    adamw = OptimSpec(torch.optim.AdamW, lr=1e-3)
    makes = {"sync DiLoCo": lambda: DiLoCoStrategy(adamw, H=args.H),
             "async DiLoCo": lambda: AsyncDiLoCoStrategy(adamw, H=args.H)}
    best = {name: float("inf") for name in makes}
    run(makes["sync DiLoCo"], args.nodes, args.H)  # warm-up
    for _ in range(args.repeat):
        for name, make in makes.items():
            best[name] = min(best[name], run(make, args.nodes, args.steps))
    print(f"K={args.nodes}, {args.steps} steps, H={args.H}, MLP 784-256-256-10, batch 32, one thread\n")
    print("| run | ms per node-step | vs sync DiLoCo |\n|---|---|---|")
    for name in makes:
        print(f"| {name} | {best[name] * 1e3:.3f} | {best[name] / best['sync DiLoCo']:.3f}x |")


if __name__ == "__main__":
    main()
