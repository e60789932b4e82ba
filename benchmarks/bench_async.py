"""The event order's cost: asynchronous DiLoCo against synchronous DiLoCo on the same work.

K = 16 nodes of the MLP 784-256-256-10 (benchmarks/workload.py) on MNIST-shaped data, batch 32 per node,
H = 10, AdamW inner, the same steps; a WAN network model and node speeds 1.0 ... 0.25 (so the asynchronous
run's event order is not trivial). Synchronous DiLoCo meets in one all-reduce per round; AsyncDiLoCo sends
each node's pseudo-gradient to the server (a message each way per round, every arrival and observation
through the post office's event queue). Printed: wall seconds per node-step of each, and their ratio, the
runs interleaved in one process (the fastest of --repeat counts).

With --processes P: asynchronous DiLoCo on one process against the same run over P processes (fit(processes=P): the
process holding node 0 keeps the event heap, the others forward to it; exogym.backends.sim.postlink), its wall
seconds per node-step and the ratio, with the machine's load average (the runs give the same bits; the keeper takes
an event while other processes' nodes compute when none of them can cause an earlier one, the lookahead), and how
long each process of the last P-process run had no node to run (the record's process_waited_s).
--model cnn: the small CNN of benchmarks/workload.py instead (more compute per step, against the same round trips
to the keeper). Beside it, this machine's limit: the same node-steps with no simulator (K copies of the model, each
node's H steps in a row, a step a batch gathered, forward, backward, AdamW), in one process against P processes each holding K/P copies, timed
from a barrier after start-up and a warm-up (every process runs its whole share once first: a process's first pass
ran 15 to 30% slower than its next ones) to the last process's end: what two processes computing at once on this
machine give with nothing to wait for (cores that slow each other, as shared caches and a VM's neighbours make them).
Every process builds the same K copies and keeps its block, so P processes compute the values one does: a CNN step's
time depends on the values (max pooling branches on them), so the plain loop's copies, trained apart, are not timed
against exogym's, whose nodes restart from the server's model each round, only against themselves.
--latency: the `home` network with another latency (the lookahead across processes reaches that far ahead).
Usage: python benchmarks/bench_async.py [--nodes 16] [--steps 100] [--repeat 3] [--processes P] [--model mlp|cnn]
       [--latency 150ms]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

from exogym import Trainer
from exogym.cluster.network import Network
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec
from workload import MLP, SmallCNN, fastest_interleaved, make_data

MODELS = {"mlp": (MLP, "MLP 784-256-256-10"), "cnn": (SmallCNN, "small CNN")}
LAST_WAITS: dict[int, tuple[float, list[float]]] = {}  # processes -> the last run's (wall seconds, each one's waits)


def run(make, k: int, steps: int, processes: int = 1, model: str = "mlp", latency: str | None = None) -> float:
    torch.manual_seed(0)
    trainer = Trainer(MODELS[model][0](), make_data(k * 32 * 4))
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]
    network = "home" if latency is None else Network.preset("home", latency=latency)
    start = time.perf_counter()
    trainer.fit(make(), k, max_steps=steps, batch_size=32, network=network, node_speeds=speeds, device="cpu",
                logger=False, progress=False, processes=processes)
    seconds = time.perf_counter() - start
    if processes > 1:  # each process's wall seconds with no node to run, waiting on the others (one figure a process)
        waits = dict.fromkeys(c["process_waited_s"] for c in trainer.record.comm_per_node)
        LAST_WAITS[processes] = (seconds, list(waits))
    return seconds / (k * steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--latency", help="the `home` network with this latency instead of its 30ms (e.g. 150ms): "
                                          "with --processes, how far the lookahead reaches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    adamw = OptimSpec(torch.optim.AdamW, lr=1e-3)
    if args.processes > 1:
        compare_processes(lambda: AsyncDiLoCoStrategy(adamw, H=args.H), args)
        return
    makes = {"sync DiLoCo": lambda: DiLoCoStrategy(adamw, H=args.H),
             "async DiLoCo": lambda: AsyncDiLoCoStrategy(adamw, H=args.H)}
    best = {name: float("inf") for name in makes}
    run(makes["sync DiLoCo"], args.nodes, args.H, model=args.model)  # warm-up
    for _ in range(args.repeat):
        for name, make in makes.items():
            best[name] = min(best[name], run(make, args.nodes, args.steps, model=args.model))
    print(f"K={args.nodes}, {args.steps} steps, H={args.H}, {MODELS[args.model][1]}, batch 32, one thread\n")
    print("| run | ms per node-step | vs sync DiLoCo |\n|---|---|---|")
    for name in makes:
        print(f"| {name} | {best[name] * 1e3:.3f} | {best[name] / best['sync DiLoCo']:.3f}x |")


def _plain_share(rank: int, processes: int, k: int, steps: int, H: int, model: str, barrier, out) -> None:
    """Process `rank`'s block of the K nodes' steps with no simulator; puts its seconds from the barrier on."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    xs, ys = make_data(k * 32 * 4).tensors
    # every process builds all K copies from the one seed and keeps its own block, so that P processes compute the
    # same values as one (a step's time depends on them: max pooling branches on its input)
    models = [MODELS[model][0]() for _ in range(k)][rank * k // processes:(rank + 1) * k // processes]
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(0))

    def share() -> None:
        for first in range(0, steps, H):  # a node's H steps in a row, as an asynchronous round runs them
            for m, optim in zip(models, optims):
                for step in range(first, min(first + H, steps)):
                    idx = order[(step * 32) % len(xs):][:32]  # [32]
                    optim.zero_grad()
                    m((xs.index_select(0, idx), ys.index_select(0, idx))).backward()
                    optim.step()

    share()  # warm: the allocator, the kernels, the optimizers' state (module docstring)
    barrier.wait()
    start = time.perf_counter()
    share()
    out.put(time.perf_counter() - start)


def plain_processes(k: int, steps: int, H: int, processes: int, model: str) -> float:
    """Wall seconds per node-step of the plain node-steps over `processes` processes (the last to end)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_plain_share, args=(r, processes, k, steps, H, model, barrier, out))
             for r in range(processes)]
    for p in procs:
        p.start()
    seconds = max(out.get() for _ in procs)
    for p in procs:
        p.join()
    return seconds / (k * steps)


def compare_processes(make, args: argparse.Namespace) -> None:
    counts = (1, args.processes)
    run(make, args.nodes, args.H, args.processes, args.model, args.latency)  # warm-up (the processes' imports), short
    runs = {("exogym", p): lambda p=p: run(make, args.nodes, args.steps, p, args.model, args.latency) for p in counts}
    runs.update({("plain", p): lambda p=p: plain_processes(args.nodes, args.steps, args.H, p, args.model) for p in counts})
    best, load = fastest_interleaved(runs, args.repeat)
    print(f"async DiLoCo, K={args.nodes}, {args.steps} steps, H={args.H}, {MODELS[args.model][1]}, batch 32, "
          f"`home` network, latency {args.latency or '30ms'}, {os.cpu_count()} cores, load average (1 min, highest "
          f"seen) {load:.1f}\n")
    print("| processes | exogym, ms per node-step | vs processes=1 | plain node-steps (the machine's limit), ms "
          "per node-step | vs processes=1 |\n|---|---|---|---|---|")
    for p in counts:
        print(f"| {p} | {best['exogym', p] * 1e3:.3f} | {best['exogym', p] / best['exogym', 1]:.3f}x "
              f"| {best['plain', p] * 1e3:.3f} | {best['plain', p] / best['plain', 1]:.3f}x |")
    seconds, waits = LAST_WAITS[args.processes]
    print(f"\nexogym's last processes={args.processes} run, {seconds:.2f} s: its processes had no node to run, waiting "
          f"on the others, {' / '.join(f'{w:.2f}' for w in waits)} s (record.comm_per_node's process_waited_s)")


if __name__ == "__main__":
    main()
