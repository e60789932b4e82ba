"""Fused vs sequential execution, next to a plain loop and the one-model batching limit.

For exogym's GPT (4 layers, width 128, 8 sequences x 64 tokens per node), the MLP 784-256-256-10 and
the small CNN (32 examples per node, MNIST-shaped) at K = 8, 32, 64 nodes, DDP with AdamW:
- plain: K model copies and K AdamW optimizers in one loop, gradients averaged (no simulator);
- one model: one model, one AdamW, batch K x per-node batch (what batching could reach at best);
- sequential / fused / auto: trainer.fit(..., execution=...), DDP through a subclass that keeps K copies
  (workload.ddp_keeping_k_copies: the plain loop's arithmetic; SimpleReduceStrategy itself keeps one
  replica in sequential runs, which no fused run can, so comparing with it would not compare the executions).
Times are seconds per step after warm-up (exogym: inside one run, from node 0's strategy step at the end of
the warm-up to its last, so setup and the "auto" probe stay outside; the time to the end of the warm-up,
probe included, is printed apart). Each cell runs
in a fresh process, so peak memory (max RSS) is its own; the table prints ratios to the plain loop.
Usage: python benchmarks/bench_fused.py [--steps 20] [--warmup 3] [--models gpt mlp cnn] [--nodes 8 32 64]
       [--threads 1] [--cpu-time] [--repeat 2]
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

from workload import MLP, SmallCNN, average_grads, ddp_keeping_k_copies, make_data, make_tokens

MODES = ("plain", "one model", "sequential", "fused", "auto")


def workload(name: str):
    """(model factory, dataset of n examples, per-node batch)."""
    if name == "gpt":
        from exogym.models.gpt import GPT
        return (lambda: GPT(65, 64, n_layer=4, n_head=4, n_embd=128)), make_tokens, 8
    return (MLP if name == "mlp" else SmallCNN), make_data, 32


def time_plain(model_name: str, k: int, steps: int, warmup: int, one_model: bool, clock) -> float:
    make_model, make_dataset, batch = workload(model_name)
    data = make_dataset(k * batch * (steps + warmup))
    torch.manual_seed(0)
    models = [make_model() for _ in range(1 if one_model else k)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    shards = [torch.as_tensor(list(DistributedSampler(data, num_replicas=k, rank=r, shuffle=True, seed=0)))
              for r in range(k)]

    def node_batch(r: int, s: int):
        idx = shards[r][s * batch:(s + 1) * batch]
        return tuple(t[idx] for t in data.tensors)

    def out_loss(out):
        return out["loss"] if isinstance(out, dict) else out

    for s in range(steps + warmup):
        if s == warmup:
            start = clock()
        if one_model:
            parts = [node_batch(r, s) for r in range(k)]
            opts[0].zero_grad()
            out_loss(models[0](tuple(torch.cat(ts) for ts in zip(*parts)))).backward()
            opts[0].step()
            continue
        for r in range(k):
            opts[r].zero_grad()
            out_loss(models[r](node_batch(r, s))).backward()
        average_grads(models)
        for o in opts:
            o.step()
    return (clock() - start) / steps


def time_exogym(model_name: str, k: int, steps: int, warmup: int, execution: str, clock) -> tuple[float, float, str]:
    """Seconds per step, timed inside one run from node 0's strategy step after the warm-up steps to its last (the
    run's setup and the auto probe, whose times vary from run to run, stay outside), the time from the start of
    that run to the end of the warm-up (setup and probe included) and the execution chosen."""
    import warnings

    from exogym import Trainer
    from exogym.strategy import OptimSpec

    make_model, make_dataset, batch = workload(model_name)
    data = make_dataset(k * batch * (steps + warmup))
    stamps: list[float] = []
    strategy = ddp_keeping_k_copies(OptimSpec(torch.optim.AdamW, lr=1e-3))

    class Timed(type(strategy)):
        def step(self):
            super().step()
            if self.rank == 0:  # every node has stepped by node 0's next step: DDP waits in the all-reduce
                stamps.append(clock())

    for n in (1, warmup + steps):  # the first run pays the process's one-time costs (imports, kernels)
        torch.manual_seed(0)
        trainer = Trainer(make_model(), data)
        stamps.clear()
        started = clock()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Timed(OptimSpec(torch.optim.AdamW, lr=1e-3)), k, batch_size=batch, max_steps=n, device="cpu",
                        progress=False, logger=False, execution=execution)
    return (stamps[-1] - stamps[warmup - 1]) / steps, stamps[warmup - 1] - started, trainer.record.config["execution"]


def child(model_name: str, mode: str, k: int, steps: int, warmup: int, threads: int, cpu_time: bool) -> None:
    if threads:
        torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    if mode in ("plain", "one model"):
        out = {"s": time_plain(model_name, k, steps, warmup, mode == "one model", clock)}
    else:
        s, setup, chosen = time_exogym(model_name, k, steps, warmup, mode, clock)
        out = {"s": s, "setup": setup, "chosen": chosen}
    out["mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    print(json.dumps(out))


def measure(model_name: str, mode: str, k: int, steps: int, warmup: int, threads: int, cpu_time: bool,
            repeat: int) -> dict:
    """The cell's fastest of `repeat` fresh processes (its peak memory: the largest)."""
    best: dict | None = None
    for _ in range(repeat):
        out = subprocess.run([sys.executable, __file__, "--child", model_name, mode, str(k), str(steps), str(warmup),
                              str(threads), str(int(cpu_time))],
                             capture_output=True, text=True)
        if out.returncode:
            return {"error": out.stderr.strip().splitlines()[-1]}
        cell = json.loads(out.stdout.strip().splitlines()[-1])
        if best is not None:
            cell["mb"] = max(cell["mb"], best["mb"])
        best = cell if best is None or cell["s"] < best["s"] else {**best, "mb": cell["mb"]}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["gpt", "mlp", "cnn"], choices=["gpt", "mlp", "cnn"])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads in each run (0: torch's default); 1 keeps a shared machine's load from "
                             "stalling multi-threaded kernels")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with the process's CPU clock (with --threads 1: robust to other processes' load)")
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per cell; the fastest counts")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, mode, k, steps, warmup, threads, cpu_time = args.child
        return child(model_name, mode, int(k), int(steps), int(warmup), int(threads), cpu_time == "1")
    print(f"DDP + AdamW, {args.steps} timed steps after {args.warmup} warm-up, fastest of {args.repeat}, "
          f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} thread(s), "
          f"{'CPU' if args.cpu_time else 'wall'} time; time per step relative to the plain loop (peak MB)")
    print(f"{'model':>5} {'K':>3} {'plain s/step':>12} " + " ".join(f"{m:>16}" for m in args.modes[1:])
          + "  fused/one-model  auto chose (warm-up run s)")
    for model_name in args.models:
        for k in args.nodes:
            cells = {m: measure(model_name, m, k, args.steps, args.warmup, args.threads, args.cpu_time, args.repeat)
                     for m in args.modes}
            plain = cells.get("plain", {}).get("s")
            row = f"{model_name:>5} {k:>3} {plain if plain else float('nan'):>12.4f} "
            for m in args.modes[1:]:
                c = cells[m]
                row += (f"{'error':>16} " if "error" in c else
                        f"{c['s'] / plain:>8.2f} ({c['mb']:>5.0f}) " if plain else f"{c['s']:>8.4f} ({c['mb']:>5.0f}) ")
            fused, one = cells.get("fused", {}).get("s"), cells.get("one model", {}).get("s")
            row += f" {fused / one:>15.2f}" if fused and one else f" {'-':>15}"
            if "auto" in cells and "chosen" in cells["auto"]:
                row += f"  {cells['auto']['chosen']} ({cells['auto']['setup']:.1f})"
            print(row, flush=True)
            for m, c in cells.items():
                if "error" in c:
                    print(f"      {m}: {c['error']}", flush=True)


if __name__ == "__main__":
    main()
