"""Peak resident memory of a K-node run: the sim backend per strategy, next to what per-node state costs.

exogym's GPT (6 layers, width 384, 10.8M weights), batch 4 x 128 tokens per node, a few steps on random
tokens. Each configuration runs in a fresh process and reports its peak RSS (ru_maxrss). Beside it:
- "K copies": the bytes of the state a node holds, times K (parameters 4, gradients 4 per weight, and the
  optimizer's: AdamW 8, DeMo's momentum 4, SGD 0; DiLoCo adds the outer model and its momentum, 8), which
  is what one process per node, or a simulator holding everything per node, keeps;
- "plain loop": K model copies with their optimizers in one process, stepping one after another (measured
  with --plain).
Then, per strategy, the line through the smallest and largest K: GiB per node, the fixed part, and the largest K
whose peak fits in --budget GiB (24: this machine).
Usage: python benchmarks/bench_memory.py [--nodes 8 64] [--strategies ddp diloco sparta fedavg demo]
       [--steps 3] [--plain] [--budget 24]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from torch.utils.data import TensorDataset

VOCAB, BLOCK, BATCH = 65, 128, 4
OPTIM_BYTES = {"ddp": 8, "diloco": 8, "sparta": 8, "fedavg": 0, "demo": 4}  # optimizer state per weight
OUTER_BYTES = {"diloco": 8}  # DiLoCo's outer model and Nesterov momentum


def _model():
    from exogym.models.gpt import GPT
    torch.manual_seed(0)
    return GPT(VOCAB, BLOCK, n_layer=6, n_head=6, n_embd=384)


def _strategy(name: str):
    from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, SimpleReduceStrategy,
                                 SPARTAStrategy)
    return {"ddp": lambda: SimpleReduceStrategy("adamw", lr=3e-4),
            "diloco": lambda: DiLoCoStrategy("adamw", lr=3e-4, H=10),
            "sparta": lambda: SPARTAStrategy("adamw", lr=3e-4, p_sparta=0.005),
            "fedavg": lambda: FedAvgStrategy("sgd", lr=0.1, H=10),
            "demo": lambda: DeMoStrategy(lr=3e-4)}[name]()


def _data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _child(kind: str, strategy: str, k: int, steps: int) -> None:
    torch.set_num_threads(1)
    start = time.perf_counter()
    if kind == "sim":
        from exogym import Trainer
        Trainer(_model(), _data(k * BATCH * steps)).fit(_strategy(strategy), k, batch_size=BATCH, max_steps=steps,
                                                         progress=False, logger=False, device="cpu")
    else:  # the plain loop: K copies and their optimizers, one node after another
        models = [_model() for _ in range(k)]
        opts = [torch.optim.AdamW(m.parameters(), lr=3e-4) for m in models]
        data = _data(BATCH)
        for _ in range(steps):
            for m, opt in zip(models, opts):
                m((data.tensors[0], data.tensors[1]))["loss"].backward()
                opt.step()
                opt.zero_grad()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({"peak_gib": peak, "seconds": time.perf_counter() - start}))


def _measure(kind: str, strategy: str, k: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, strategy, str(k), str(steps)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--strategies", nargs="+", default=list(OPTIM_BYTES), choices=list(OPTIM_BYTES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--plain", action="store_true", help="also measure the plain loop holding K copies")
    ap.add_argument("--budget", type=float, default=24.0, help="GiB for the largest-K column (default 24: this machine)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, strategy, k, steps = args.child
        _child(kind, strategy, int(k), int(steps))
        return
    weights = sum(p.numel() for p in _model().parameters())
    print(f"GPT: {weights / 1e6:.1f}M weights; batch {BATCH} x {BLOCK} tokens per node; {args.steps} steps; "
          f"one thread; peak RSS of a fresh process per row")
    print("| strategy | K | sim peak GiB | K copies of per-node state GiB | sim / K copies | seconds |")
    print("|---|---|---|---|---|---|")
    peaks: dict[str, dict[int, float]] = {name: {} for name in args.strategies}
    for k in args.nodes:
        for name in args.strategies:
            copies = k * weights * (4 + 4 + OPTIM_BYTES[name] + OUTER_BYTES.get(name, 0)) / 2**30
            sim = _measure("sim", name, k, args.steps)
            peaks[name][k] = sim["peak_gib"]
            print(f"| {name} | {k} | {sim['peak_gib']:.2f} | {copies:.2f} | {sim['peak_gib'] / copies:.2f} | "
                  f"{sim['seconds']:.0f} |", flush=True)
        if args.plain:
            plain = _measure("plain", "ddp", k, args.steps)
            print(f"| plain loop, AdamW | {k} | {plain['peak_gib']:.2f} | {k * weights * 16 / 2**30:.2f} | "
                  f"{plain['peak_gib'] / (k * weights * 16 / 2**30):.2f} | {plain['seconds']:.0f} |", flush=True)
    if len(args.nodes) > 1:
        print_capacity(peaks, args.budget)


def print_capacity(peaks: dict[str, dict[int, float]], budget: float) -> None:
    """The largest K whose peak fits in `budget` GiB, on the line through the smallest and largest K measured
    (memory grows linearly with K: a fixed part, and what each node holds)."""
    print(f"\n| strategy | GiB per node (slope) | fixed GiB (intercept) | largest K in {budget:g} GiB |")
    print("|---|---|---|---|")
    for name, by_k in peaks.items():
        (k0, m0), (k1, m1) = min(by_k.items()), max(by_k.items())
        slope = (m1 - m0) / (k1 - k0)
        fixed = m0 - slope * k0
        largest = "no limit from memory (less than 1 MiB per node)" if slope < 2**-10 else f"{int((budget - fixed) / slope):,}"
        print(f"| {name} | {slope:.4f} | {fixed:.2f} | {largest} |")


if __name__ == "__main__":
    main()
