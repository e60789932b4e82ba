"""Scaling K in the DiLoCo scaling-laws setting: DDP against DiLoCo with K = 1, 2, 4, 8 replicas on Shakespeare.

    OMP_NUM_THREADS=1 python examples/shakespeare_scaling.py             # 24 runs, ~30 minutes on one CPU thread
    OMP_NUM_THREADS=1 python examples/shakespeare_scaling.py --quick     # a smoke test, about a minute
    python examples/shakespeare_scaling.py --workers 2                   # two runs at once, one thread each

The setting of Charles et al. 2025, "Communication-Efficient Language Model Training Scales Reliably
and Robustly: Scaling Laws for DiLoCo" (arXiv 2503.09799), at toy scale: a character-level GPT, the
global batch split across the K replicas (every run sees the same tokens in the same steps), H=30
inner AdamW steps per round, Nesterov outer SGD (momentum 0.9) with its learning rate swept per K.
DDP runs on K nodes too: without dropout it computes the same gradient as one node on the global
batch, so its row is a check as well as the baseline. Every run starts from the same weights and has
the same warmup + cosine schedule. Printed: a markdown table (held-out loss per K and outer lr, the
best lr, DDP, the gap, MB sent per node) and text from the best models; the plot (held-out loss
against outer lr, one line per K, DDP dashed) and the table go to --out.

The runs are an exogym sweep (exogym.sweep): DDP at each K, and DiLoCo at each K and outer lr, each a run
folder under --out/<preset>-seed<seed>/runs/ with the sweep's own table, frontier and heatmap beside them.
Run the script again and the sweep resumes: finished runs are read, not rerun; a run that was interrupted
runs again.
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
from exogym.sweep import grid, sweep

BLOCK = 64  # characters of context per example
# "full" is sized for a 2-core CPU: its 24 runs (4 DDP, 20 DiLoCo) in ~30 minutes on one thread.
PRESETS = {
    "full": {"steps": 450, "global_batch": 32, "n_layer": 3, "n_head": 4, "n_embd": 96, "ks": [1, 2, 4, 8],
             "outer_lrs": [0.2, 0.4, 0.6, 0.8, 1.0], "val_blocks": 0},
    "quick": {"steps": 120, "global_batch": 16, "n_layer": 2, "n_head": 4, "n_embd": 64, "ks": [1, 4],
              "outer_lrs": [0.4, 1.0], "val_blocks": 512},
}


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
    parser.add_argument("--workers", type=int, default=1, help="runs at once, each in its own process")
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


@dataclass(frozen=True)
class ScalingRun:
    """One run of the study: sweep(ScalingRun(...), ...) calls it with {"strategy", "nodes", "outer_lr", "seed"}.
    A dataclass at module level, so that --workers N can send it to worker processes."""

    steps: int
    global_batch: int
    n_layer: int
    n_head: int
    n_embd: int
    H: int
    lr: float
    val_blocks: int

    def __call__(self, config: dict, run) -> tuple:  # run: the sweep's settings for this run (SweepRun)
        train, blocks = _data(self.val_blocks)
        torch.manual_seed(config["seed"])  # the same initial weights for every run; no dropout, so DDP on K = 1 node
        model = GPT(train.vocab.size, BLOCK, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)
        adamw = OptimSpec(torch.optim.AdamW, lr=self.lr, weight_decay=0.1)
        common = {"max_norm": 1.0, "warmup_steps": max(1, self.steps // 10), "cosine_anneal": True}
        strategy = (SimpleReduceStrategy(adamw, **common) if config["strategy"] == "ddp" else
                    DiLoCoStrategy(adamw, H=self.H, outer_lr=config["outer_lr"], outer_momentum=0.9, nesterov=True,
                                   **common))
        k = config["nodes"]
        trainer = Trainer(model, train, None)
        final = trainer.fit(strategy, k, max_steps=self.steps, batch_size=self.global_batch // k, seed=config["seed"],
                            device="cpu", **run.fit_kwargs)
        torch.save(final.state_dict(), run.folder / "model.pt")  # the model beside the run's record, for the samples
        return trainer.record, {"held_out_loss": held_out_loss(final, blocks)}


_DATA: dict[int, tuple] = {}


def _data(val_blocks: int) -> tuple[CharBlocks, tuple[torch.Tensor, torch.Tensor]]:
    """The training blocks and the held-out blocks, loaded once per process."""
    if val_blocks not in _DATA:
        train, val = load_shakespeare("train", block_size=BLOCK), load_shakespeare("val", block_size=BLOCK)
        _DATA[val_blocks] = (train, held_out_blocks(val, val_blocks))
    return _DATA[val_blocks]


def _row(rows: list[dict], strategy: str, k: int, lr: float | None = None) -> dict:
    return next(r for r in rows if r["strategy"] == strategy and r["nodes"] == k and (lr is None or r["outer_lr"] == lr))


def markdown_table(rows: list[dict], ks: list[int], lrs: list[float]) -> str:
    lines = ["| K | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr | best DiLoCo | DDP | gap | "
             "MB/node DiLoCo | MB/node DDP |",
             "|---|" + "---:|" * (len(lrs) + 6)]
    for k in ks:
        diloco = {lr: _row(rows, "diloco", k, lr) for lr in lrs}
        ddp = _row(rows, "ddp", k)
        best = min(diloco.values(), key=lambda r: r["objective"])
        gap = 100 * (best["objective"] - ddp["objective"]) / ddp["objective"]
        lines.append(f"| {k} | " + " | ".join(f"{diloco[lr]['objective']:.4f}" for lr in lrs) +
                     f" | {best['outer_lr']:g} | {best['objective']:.4f} | {ddp['objective']:.4f} | {gap:+.2f}% | "
                     f"{best['wire_bytes_per_node'] / 1e6:.2f} | {ddp['wire_bytes_per_node'] / 1e6:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], ks: list[int], lrs: list[float], out: Path) -> Path | None:
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
        ax.plot(lrs, [_row(rows, "diloco", k, lr)["objective"] for lr in lrs], marker="o", color=color,
                label=f"DiLoCo K={k}")
        ax.axhline(_row(rows, "ddp", k)["objective"], color=color, linestyle="--", linewidth=1,
                   label=f"DDP, {k} node{'s' * (k > 1)}")
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
    run = ScalingRun(args.steps, args.global_batch, args.n_layer, args.n_head, args.n_embd, args.H, args.lr,
                     args.val_blocks)
    train, blocks = _data(args.val_blocks)
    params = sum(p.numel() for p in GPT(train.vocab.size, BLOCK, n_layer=args.n_layer, n_head=args.n_head,
                                        n_embd=args.n_embd).parameters())
    print(f"GPT {args.n_layer}x{args.n_embd} ({params:,} parameters); {args.steps} steps x {args.global_batch} "
          f"blocks x {BLOCK} characters = {args.steps * args.global_batch * BLOCK:,} training tokens per run; "
          f"H={args.H} ({args.steps // args.H} rounds); held-out: {len(blocks[0]) * BLOCK:,} characters; "
          f"seed {args.seed}\n", flush=True)

    # DDP at every K, DiLoCo at every K and outer lr: a union of two grids, 4 + 20 runs for "full".
    space = (grid(strategy="ddp", nodes=args.ks, seed=[args.seed]) +
             grid(strategy="diloco", nodes=args.ks, outer_lr=args.outer_lrs, seed=[args.seed]))
    folder = args.out / f"sweep-seed{args.seed}"
    start_all = time.perf_counter()
    result = sweep(run, space, out=folder, objective="held_out_loss", extra_metrics=["held_out_loss"],
                   workers=args.workers, resume=(folder / "sweep.json").exists())
    total = time.perf_counter() - start_all
    rows = result.table()
    unfinished = [r for r in rows if r["status"] != "completed"]
    if unfinished:
        raise SystemExit(f"{len(unfinished)} runs did not complete (see {folder / 'results.md'}); run the script "
                         "again to resume")

    table = markdown_table(rows, args.ks, args.outer_lrs)
    prompt = train.vocab.encode("ROMEO:\n").unsqueeze(0)  # [1, T]
    samples = []
    for name in ("ddp", "diloco"):  # text from the best model of each strategy
        best = min((r for r in rows if r["strategy"] == name), key=lambda r: r["objective"])
        model = GPT(train.vocab.size, BLOCK, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
        model.load_state_dict(torch.load(Path(best["run_dirs"]) / "model.pt", weights_only=True))
        ids = model.generate(prompt, args.sample, temperature=0.8, top_k=20,
                             generator=torch.Generator().manual_seed(args.seed))[0]
        label = f"{'DDP' if name == 'ddp' else 'DiLoCo'} K={best['nodes']}" + \
            (f" outer lr {best['outer_lr']:g}" if name == "diloco" else "")
        samples.append((best["objective"], f"--- {label} (held-out loss {best['objective']:.4f}) ---\n"
                                           f"{train.vocab.decode(ids)}"))
    samples = [text for _, text in sorted(samples)]
    report = f"{table}\n\n{len(rows)} runs; the sweep took {total:.0f} s this time (runs already finished are " \
             f"read, not rerun)\n\n" + "\n\n".join(samples)
    print(f"\n{report}")

    (args.out / "results.md").write_text(report + "\n")
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                                for k, v in vars(args).items()},
                                                       "parameters": params, "sweep": str(folder),
                                                       "runs": [{k: r[k] for k in ("strategy", "nodes", "outer_lr",
                                                                                   "objective", "wire_bytes_per_node",
                                                                                   "wall_time_s")} for r in rows]},
                                                      indent=1))
    path = plot(rows, args.ks, args.outer_lrs, args.out)
    print(f"\nsaved: {args.out / 'results.md'}, {args.out / 'results.json'}"
          + (f", {path}" if path else " (install matplotlib for the plot: pip install 'exogym[plot]')"))


if __name__ == "__main__":
    main()
