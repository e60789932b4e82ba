"""Sim backend vs a plain single-process PyTorch loop doing the same K-node arithmetic.

For K = 1, 2, 4, 8 nodes: a small CNN on MNIST-shaped data, DDP (gradient all-reduce every
step), batch 32 per node. The plain loop keeps K model copies and K optimizers, runs each
node's forward/backward in turn, averages the gradients and steps every optimizer: the
least a simulator holding K copies must do. The sim runs twice: as DDP is run ("sim", one
replica for all nodes, exogym.strategy.replica: one optimizer step per step, so it can be
faster than the plain loop), and with a DDP subclass that keeps K copies ("sim K copies":
the plain loop's arithmetic, so its ratio is the simulator's own overhead). Each
configuration runs in a fresh process so peak memory (max RSS) is its own; each is repeated
and the fastest run counts.
Usage: python benchmarks/bench_sim.py [--steps 200] [--nodes 1 2 4 8] [--repeat 3] [--threads 1 --cpu-time]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch.utils.data import DistributedSampler

from workload import SmallCNN, average_grads, ddp_keeping_k_copies, make_data


def run_plain(k: int, steps: int, batch: int, clock=time.perf_counter) -> float:
    data = make_data(k * batch * steps)
    torch.manual_seed(0)
    base = SmallCNN()
    models = [SmallCNN() for _ in range(k)]
    for m in models:
        m.load_state_dict(base.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    shards = []
    for r in range(k):
        sampler = DistributedSampler(data, num_replicas=k, rank=r, shuffle=True, seed=0)
        shards.append(torch.as_tensor(list(sampler)))
    start = clock()
    for s in range(steps):
        for r in range(k):
            idx = shards[r][s * batch:(s + 1) * batch]
            opts[r].zero_grad()
            models[r]((data.tensors[0][idx], data.tensors[1][idx])).backward()
        average_grads(models)
        for o in opts:
            o.step()
    return clock() - start


def run_sim(k: int, steps: int, batch: int, clock=time.perf_counter, copies: bool = False) -> float:
    from exogym import Trainer
    from exogym.strategy import OptimSpec, SimpleReduceStrategy

    trainer = Trainer(SmallCNN(), make_data(k * batch * steps))
    spec = OptimSpec(torch.optim.AdamW, lr=1e-3)
    strategy = ddp_keeping_k_copies(spec) if copies else SimpleReduceStrategy(spec)
    start = clock()
    trainer.fit(strategy, k, batch_size=batch, max_steps=steps, device="cpu", progress=False, log_interval=50)
    return clock() - start


def child(mode: str, k: int, steps: int, batch: int, threads: int, cpu_time: bool) -> None:
    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    run = {"sim": run_sim, "copies": lambda *a, **kw: run_sim(*a, **kw, copies=True), "plain": run_plain}[mode]
    run(k, 5, batch)  # warm-up: first-call kernel selection and allocator growth are not what we compare
    seconds = run(k, steps, batch, clock)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps({"seconds": seconds, "peak_mb": peak_mb}))


def measure(mode: str, k: int, steps: int, batch: int, threads: int, cpu_time: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(k), str(steps), str(batch), str(threads),
                          str(int(cpu_time))],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts (least disturbed)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU clock (with --threads 1: robust to other processes' load)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, k, steps, batch, threads, cpu_time = args.child
        return child(mode, int(k), int(steps), int(batch), int(threads), cpu_time == "1")
    print(f"DDP, small CNN, {args.steps} steps, batch {args.batch}/node, torch {torch.__version__}, "
          f"{args.threads or torch.get_num_threads()} thread(s), {'CPU' if args.cpu_time else 'wall'} time")
    print(f"{'K':>3} {'plain s':>9} {'sim K copies s':>15} {'/plain':>7} {'sim s':>9} {'/plain':>7} "
          f"{'plain MB':>9} {'copies MB':>10} {'sim MB':>9}")
    for k in args.nodes:
        runs = {"plain": [], "copies": [], "sim": []}
        for _ in range(args.repeat):  # interleaved, so a disturbance hits every side alike
            for mode in runs:
                runs[mode].append(measure(mode, k, args.steps, args.batch, args.threads, args.cpu_time))
        plain, copies, sim = (min(r, key=lambda m: m["seconds"]) for r in runs.values())
        print(f"{k:>3} {plain['seconds']:>9.2f} {copies['seconds']:>15.2f} {copies['seconds'] / plain['seconds']:>7.3f} "
              f"{sim['seconds']:>9.2f} {sim['seconds'] / plain['seconds']:>7.3f} {plain['peak_mb']:>9.0f} "
              f"{copies['peak_mb']:>10.0f} {sim['peak_mb']:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
