"""Scaling K in the DiLoCo scaling-laws setting: DDP against DiLoCo with K = 1, 2, 4, 8 replicas on Shakespeare.

    OMP_NUM_THREADS=1 python examples/shakespeare_scaling.py           # 24 runs, ~30 minutes on one CPU thread
    OMP_NUM_THREADS=1 python examples/shakespeare_scaling.py --quick   # a smoke test, about a minute

The setting of Charles et al. 2025, "Communication-Efficient Language Model Training Scales Reliably
and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799), at toy scale: a character-level GPT, the
global batch split across the K replicas (every run sees the same tokens in the same steps), H=30
inner AdamW steps per round, Nesterov outer SGD (momentum 0.9) with its learning rate swept per K.
DDP runs on K nodes too: without dropout it computes the same gradient as one node on the global
batch, so its row is a check as well as the baseline. Every run starts from the same weights and has
the same warmup + cosine schedule. Printed: a markdown table (held-out loss per K and outer lr, the
best lr, DDP, the gap, MB sent per node) and text from the best models; the plot (held-out loss
against outer lr, one line per K, DDP dashed) and the table go to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from exogym import Trainer
from exogym.data.shakespeare import CharBlocks, load_shakespeare
from exogym.models import GPT
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy

BLOCK = 64  # characters of context per example
# "full" is sized for a 2-core CPU: its 24 runs (4 DDP, 20 DiLoCo) in ~30 minutes on one thread.
PRESETS = {
    "full": {"steps": 450, "global_batch": 32, "n_layer": 3, "n_head": 4, "n_embd": 96, "ks": [1, 2, 4, 8],
             "outer_lrs": [0.2, 0.4, 0.6, 0.8, 1.0], "val_blocks": 0},
    "quick": {"steps": 120, "global_batch": 16, "n_layer": 2, "n_head": 4, "n_embd": 64, "ks": [1, 4],
              "outer_lrs": [0.4, 1.0], "val_blocks": 512},
}


@dataclass
class Result:
    strategy: str  # "DDP" or "DiLoCo"
    nodes: int
    outer_lr: float | None  # None for DDP
    loss: float  # held-out cross-entropy, nats per character
    mb_per_node: float
    seconds: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 2x64 GPT, 120 steps, K 1 and 4, outer lr 0.4 and 1")
    parser.add_argument("--steps", type=int, help="inner steps per run, a multiple of H (full: 450)")
    parser.add_argument("--global-batch", type=int, help="blocks of 64 characters per step, split over K (full: 32)")
    parser.add_argument("--n-layer", type=int, help="GPT layers (full: 3)")
    parser.add_argument("--n-head", type=int, help="attention heads (full: 4)")
    parser.add_argument("--n-embd", type=int, help="GPT width (full: 96)")
    parser.add_argument("--ks", type=int, nargs="+", help="numbers of replicas (full: 1 2 4 8)")
    parser.add_argument("--outer-lrs", type=float, nargs="+", help="outer learning rates (full: 0.2 ... 1.0)")
    parser.add_argument("--val-blocks", type=int, help="held-out blocks to evaluate on, 0 for all (full: all 7478)")
    parser.add_argument("--H", type=int, default=30, help="inner steps per round (the paper's 30)")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner AdamW peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="weights, data order and sampling")
    parser.add_argument("--sample", type=int, default=300, help="characters to generate from the best models")
    parser.add_argument("--out", type=Path, default=Path("runs/shakespeare_scaling"))
    args = parser.parse_args()
    for name, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps % args.H:
        raise SystemExit(f"--steps must be a multiple of H={args.H} so that the last round reaches the global "
                         f"model, got {args.steps}; use {args.steps // args.H * args.H or args.H} or "
                         f"{(args.steps // args.H + 1) * args.H}")
    bad = [k for k in args.ks if k < 1 or args.global_batch % k]
    if bad:
        raise SystemExit(f"every K must divide --global-batch={args.global_batch} (the batch is split over the "
                         f"replicas), got K={bad}; use K in {[k for k in range(1, 17) if args.global_batch % k == 0]}")
    return args


def held_out_blocks(val: CharBlocks, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` blocks spread evenly over the validation text (all of them for 0): int64 [count, BLOCK] twice."""
    step = 1 if count <= 0 or count >= len(val) else len(val) // count
    pairs = [val[i] for i in range(0, len(val), step)][:count or None]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, blocks: tuple[torch.Tensor, torch.Tensor], batch: int = 256) -> float:
    model.eval()
    x, y = blocks
    total = sum(model((x[i:i + batch], y[i:i + batch]))["loss"].item() * len(x[i:i + batch])
                for i in range(0, len(x), batch))
    return total / len(x)  # every block has BLOCK characters, so this is the mean per character


def markdown_table(results: list[Result], ks: list[int], lrs: list[float]) -> str:
    lines = ["| K | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr | best DiLoCo | DDP | gap | "
             "MB/node DiLoCo | MB/node DDP |",
             "|---|" + "---:|" * (len(lrs) + 6)]
    for k in ks:
        diloco = {r.outer_lr: r for r in results if r.strategy == "DiLoCo" and r.nodes == k}
        ddp = next(r for r in results if r.strategy == "DDP" and r.nodes == k)
        best = min(diloco.values(), key=lambda r: r.loss)
        gap = 100 * (best.loss - ddp.loss) / ddp.loss
        lines.append(f"| {k} | " + " | ".join(f"{diloco[lr].loss:.4f}" for lr in lrs) +
                     f" | {best.outer_lr:g} | {best.loss:.4f} | {ddp.loss:.4f} | {gap:+.2f}% | "
                     f"{best.mb_per_node:.2f} | {ddp.mb_per_node:.2f} |")
    return "\n".join(lines)


def plot(results: list[Result], ks: list[int], lrs: list[float], out: Path) -> Path | None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, k in enumerate(ks):
        color = f"C{i}"
        ax.plot(lrs, [next(r.loss for r in results if r.strategy == "DiLoCo" and r.nodes == k and r.outer_lr == lr)
                      for lr in lrs], marker="o", color=color, label=f"DiLoCo K={k}")
        ddp = next(r.loss for r in results if r.strategy == "DDP" and r.nodes == k)
        ax.axhline(ddp, color=color, linestyle="--", linewidth=1, label=f"DDP, {k} node{'s' * (k > 1)}")
    ax.set_xlabel("outer learning rate (Nesterov SGD, momentum 0.9)")
    ax.set_ylabel("held-out loss (nats per character)")
    ax.set_title("DiLoCo vs DDP on Shakespeare, equal tokens per run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    path = out / "loss_vs_outer_lr.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    args = parse_args()
    train, val = load_shakespeare("train", block_size=BLOCK), load_shakespeare("val", block_size=BLOCK)
    blocks = held_out_blocks(val, args.val_blocks)

    def new_model() -> GPT:  # the same initial weights for every run; no dropout, so DDP on K nodes = 1 node
        torch.manual_seed(args.seed)
        return GPT(train.vocab.size, BLOCK, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)

    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    common = {"max_norm": 1.0, "warmup_steps": max(1, args.steps // 10), "cosine_anneal": True}
    params = sum(p.numel() for p in new_model().parameters())
    print(f"GPT {args.n_layer}x{args.n_embd} ({params:,} parameters); {args.steps} steps x {args.global_batch} "
          f"blocks x {BLOCK} characters = {args.steps * args.global_batch * BLOCK:,} training tokens per run; "
          f"H={args.H} ({args.steps // args.H} rounds); held-out: {len(blocks[0]) * BLOCK:,} characters; "
          f"seed {args.seed}\n", flush=True)

    runs = [("DDP", k, None) for k in args.ks] + [("DiLoCo", k, lr) for k in args.ks for lr in args.outer_lrs]
    results: list[Result] = []
    best: dict[str, tuple[float, str, GPT]] = {}  # per strategy: the lowest held-out loss, its label and model
    start_all = time.perf_counter()
    for name, k, outer_lr in runs:
        strategy = (SimpleReduceStrategy(adamw, **common) if name == "DDP" else
                    DiLoCoStrategy(adamw, H=args.H, outer_lr=outer_lr, outer_momentum=0.9, nesterov=True, **common))
        trainer = Trainer(new_model(), train, None)
        start = time.perf_counter()
        model = trainer.fit(strategy, k, max_steps=args.steps, batch_size=args.global_batch // k, seed=args.seed,
                            device="cpu", progress=True, logger=False)
        loss = held_out_loss(model, blocks)
        result = Result(name, k, outer_lr, loss, trainer.record.bytes_per_node[0] / 1e6, time.perf_counter() - start)
        results.append(result)
        label = f"{name} K={k}" + (f" outer lr {outer_lr:g}" if outer_lr is not None else "")
        print(f"{label:<26} held-out loss {loss:.4f}  sent/node {result.mb_per_node:8.2f} MB  "
              f"{result.seconds:5.1f} s", flush=True)
        if name not in best or loss < best[name][0]:
            best[name] = (loss, label, model)
    total = time.perf_counter() - start_all

    table = markdown_table(results, args.ks, args.outer_lrs)
    prompt = train.vocab.encode("ROMEO:\n").unsqueeze(0)  # [1, T]
    samples = []
    for loss, label, model in sorted(best.values(), key=lambda b: b[0]):
        ids = model.generate(prompt, args.sample, temperature=0.8, top_k=20,
                             generator=torch.Generator().manual_seed(args.seed))[0]
        samples.append(f"--- {label} (held-out loss {loss:.4f}) ---\n{train.vocab.decode(ids)}")
    report = f"{table}\n\n{len(runs)} runs in {total:.0f} s\n\n" + "\n\n".join(samples)
    print(f"\n{report}")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(report + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()},
                                                       "parameters": params, "total_seconds": total,
                                                       "runs": [vars(r) for r in results]}, indent=1))
    path = plot(results, args.ks, args.outer_lrs, args.out)
    print(f"\nsaved: {args.out / 'results.md'}, {args.out / 'results.json'}"
          + (f", {path}" if path else " (install matplotlib for the plot: pip install 'exogym[plot]')"))


if __name__ == "__main__":
    main()
