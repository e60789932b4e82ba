"""What do a changing compute pool and failing nodes do to DiLoCo (and DDP) on MNIST?

    python examples/elastic_compute.py              # 8 nodes, 300 steps per run, a few minutes on 2 CPU cores
    python examples/elastic_compute.py --quick      # a smoke run (~30 s)
    python examples/elastic_compute.py --update-docs   # the default run, its plot and JSON into docs/img

Part 1, the DiLoCo paper's adaptive compute pool (Douillard et al. 2023, section 3): DiLoCo with the
number of nodes held at 8 or 4, doubling (4 then 8), halving (8 then 4), ramping up (1 to 8) or down
(8 to 1). Doubling and halving use the same compute, as do ramping up and down; the paper reports
that the final loss follows the total compute more than its order. Nodes joining the pool start
from the global model.

Part 2, failures: each node fails with a given probability per step and is down for --downtime
steps (RandomFailures, the same seed for both strategies); DDP averages the gradients of the nodes
up, DiLoCo their pseudo-gradients; a node coming back downloads the global state.

Printed: per run, the compute used (node-steps, relative to 8 nodes throughout), the global model's
held-out loss and accuracy, and the MB each node sent on average; plotted: held-out loss against
steps (with matplotlib). The plot and the numbers go to runs/elastic_compute.png and .json (git-ignored;
--plot to move them, --update-docs to write docs/img/elastic_compute.png and .json, with the default
settings only).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from exogym import RandomFailures, Trainer
from exogym.data.mnist import load_mnist
from exogym.models import MnistCNN
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy
from published_output import add_update_docs, output_path, print_outputs




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.plot resolved to the plot's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--H", type=int, default=20, help="DiLoCo inner steps per round")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.005, 0.02],
                        help="per-node, per-step failure probabilities for part 2")
    parser.add_argument("--downtime", type=int, default=30, help="steps a failed node stays down")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="60 steps, 2 schedules, 1 failure rate")
    parser.add_argument("--plot", default=None,
                        help="the plot (default runs/elastic_compute.png); the numbers go next to it as a .json file")
    add_update_docs(parser, "elastic_compute.png and .json")
    args = parser.parse_args(argv)
    args.plot = output_path(parser, args, "elastic_compute.png", given=args.plot, flag="--plot")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.steps, args.rates = 60, [0.02]

    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr)
    k, half = args.nodes, max(1, args.nodes // 2)
    pools = [(f"constant {k}", None), (f"constant {half}", [(1, half)]), ("doubling", "doubling"),
             ("halving", "halving"), ("ramp up", "ramp_up"), ("ramp down", "ramp_down")]
    runs = [("DiLoCo", label, dict(active_nodes=pool)) for label, pool in (pools[:2] if args.quick else pools)]
    for rate in args.rates:
        failures = RandomFailures(rate, downtime=args.downtime, seed=args.seed) if rate else None
        for name in ("DDP", "DiLoCo"):
            runs.append((name, f"failures p={rate}", dict(failures=failures)))

    train, test = load_mnist("train"), load_mnist("test")
    print(f"{k} nodes x batch 16, {args.steps} steps, DiLoCo H={args.H}, AdamW lr {args.lr}, seed {args.seed}\n")
    results = []
    for name, label, schedule in runs:
        strategy = (DiLoCoStrategy(adamw, H=args.H) if name == "DiLoCo" else SimpleReduceStrategy(adamw))
        torch.manual_seed(args.seed)  # the same initial model for every run
        trainer = Trainer(MnistCNN(), train, test)
        trainer.fit(strategy, k, max_steps=args.steps, batch_size=16, val_size=2000,
                    val_interval=max(1, args.steps // 10), device="cpu", seed=args.seed, progress=True,
                    logger=False, **schedule)
        rec = trainer.record
        up = rec.column("nodes_up") if "nodes_up" in rec.train[0] else [k] * args.steps
        compute = sum(up) / (k * args.steps)
        final = rec.val[-1]
        sent_mb = sum(rec.bytes_per_node) / k / 1e6
        results.append((name, label, compute, final["global_loss"], final["global_accuracy"], sent_mb, rec.val))
        print(f"{name:<7} {label:<18} compute {compute:5.2f}  loss {final['global_loss']:.4f}  "
              f"accuracy {final['global_accuracy']:.4f}  sent {sent_mb:7.2f} MB/node  ({rec.wall_time_s:.0f} s)",
              flush=True)

    print("\n| strategy | schedule | compute (node-steps vs constant) | held-out loss | accuracy | MB sent per node |")
    print("|---|---|---|---|---|---|")
    for name, label, compute, loss, acc, sent, _ in results:
        print(f"| {name} | {label} | {compute:.2f} | {loss:.4f} | {acc:.4f} | {sent:.2f} |")
    numbers = args.plot.with_suffix(".json")
    numbers.write_text(json.dumps({
        "command": "python examples/elastic_compute.py" + (" --update-docs" if args.update_docs else ""),
        "steps": args.steps, "nodes": k, "H": args.H,
        "seed": args.seed, "runs": [{"strategy": name, "schedule": label, "compute": compute, "held_out_loss": loss,
                                     "accuracy": acc, "mb_sent_per_node": sent}
                                    for name, label, compute, loss, acc, sent, _ in results]}, indent=1) + "\n")
    print_outputs([numbers, *_plot(results, args.plot)])


def _plot(results: list, path: Path) -> list[Path]:
    """Held-out loss against steps, compute pools and failures side by side; returns the files written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, label, *_, val in results:
        ax = axes[0] if label.startswith(("constant", "doubling", "halving", "ramp")) else axes[1]
        ax.plot([v["step"] for v in val], [v["global_loss"] for v in val], marker="o", ms=3, label=f"{name} {label}")
    for ax, title in zip(axes, ("DiLoCo: compute pools", "failures")):
        ax.set(title=title, xlabel="step", ylabel="held-out loss (global model)", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return [path]


if __name__ == "__main__":
    main()
