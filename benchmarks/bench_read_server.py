"""What a `read_server` costs, in node 0's process and in another (fit(processes=P), backend="sim").

Asynchronous DiLoCo (K nodes of the MLP 784-256-256-10, batch 32, H=10, the speeds 1.0 ... 0.25 of bench_async.py)
whose nodes also read the server's model (`read_server(lambda s: s.theta.clone())`) every step, against the same run
without the reads, on one process and on P. Over several processes a read from a node outside node 0's process is a
round trip to it carrying the server's whole state (the model), pickled, and loaded into the node's shadow of the
server. Printed: the extra wall milliseconds per read (the difference of the two runs over the reads made), the
fastest of --repeat runs each, with the machine's load average.

Usage: python benchmarks/bench_read_server.py [--nodes 4] [--steps 40] [--repeat 3] [--processes 2]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from exogym import Trainer
from exogym.comm import read_server
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
from workload import MLP, make_data


class ReadsEveryStep(AsyncDiLoCoStrategy):
    """AsyncDiLoCo whose nodes read the server's model after every step."""

    def step(self):
        super().step()
        read_server(lambda s: s.theta.clone())


def run(cls, k: int, steps: int, processes: int) -> float:
    torch.manual_seed(0)
    trainer = Trainer(MLP(), make_data(k * 32 * 4))
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]
    start = time.perf_counter()
    trainer.fit(cls(OptimSpec(torch.optim.AdamW, lr=1e-3), H=10), k, max_steps=steps, batch_size=32,
                network="home", node_speeds=speeds, device="cpu", logger=False, progress=False, processes=processes)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = (1, args.processes)
    run(ReadsEveryStep, args.nodes, 10, args.processes)  # warm-up (the processes' imports)
    load = os.getloadavg()[0]
    best = {(cls, p): float("inf") for cls in (AsyncDiLoCoStrategy, ReadsEveryStep) for p in counts}
    for _ in range(args.repeat):
        for cls, p in best:
            best[cls, p] = min(best[cls, p], run(cls, args.nodes, args.steps, p))
    load = max(load, os.getloadavg()[0])
    reads = args.nodes * args.steps
    print(f"async DiLoCo, K={args.nodes}, {args.steps} steps, H=10, MLP 784-256-256-10, batch 32, a read per node-step "
          f"({reads} reads), {os.cpu_count()} cores, load average (1 min, highest seen) {load:.1f}\n")
    print("| processes | s without reads | s with reads | ms per read |\n|---|---|---|---|")
    for p in counts:
        plain, with_reads = best[AsyncDiLoCoStrategy, p], best[ReadsEveryStep, p]
        print(f"| {p} | {plain:.3f} | {with_reads:.3f} | {(with_reads - plain) / reads * 1e3:.3f} |")


if __name__ == "__main__":
    main()
