"""MNIST-1D: a small 1-D CNN on 4 nodes, next to the MNIST-1D paper's single-model accuracies.

    python examples/mnist1d.py               # 3000 steps per run, a few minutes on 2 CPU cores
    python examples/mnist1d.py --steps 8000  # the budget at which a single CNN reaches ~95% here
    python examples/mnist1d.py --update-docs # the default run, its JSON into docs/img

The data (4000 train / 1000 test sequences of length 40) is generated locally by the mnist1d
package (`pip install 'exogym[mnist1d]'`), identical to the published set. Every run sees the
same examples per step (global batch 100: one node x 100, or 4 nodes x 25). The numbers go to
runs/mnist1d.json (git-ignored; --out to move it, --update-docs to write docs/img/mnist1d.json, with the
default settings only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

from exogym import Trainer
from exogym.data.mnist1d import load_mnist1d
from exogym.strategy import DiLoCoStrategy, OptimSpec, SimpleReduceStrategy
from published_output import add_update_docs, output_path, print_outputs

PAPER = {"logistic regression": 0.32, "MLP": 0.68, "CNN": 0.94, "GRU": 0.91}  # Greydanus 2020, test accuracy


class Conv1dNet(nn.Module):
    """Three strided 1-D convolutions and a linear head, the paper's CNN shape; model((x, y)) -> loss, accuracy."""

    def __init__(self, channels: int = 25, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, channels, 5, stride=2, padding=1), nn.ReLU(),         # [B, C, 19]
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # [B, C, 10]
            nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),  # [B, C, 5]
            nn.Flatten(), nn.Linear(channels * 5, num_classes))

    def forward(self, batch):
        x, y = batch
        logits = self.net(x.unsqueeze(1))  # [B, 40] -> [B, 1, 40] -> [B, classes]
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.out resolved to the JSON file's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="the JSON file of the numbers (default runs/mnist1d.json)")
    add_update_docs(parser, "mnist1d.json")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "mnist1d.json", given=args.out)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    train, test = load_mnist1d("train"), load_mnist1d("test")
    adam = OptimSpec(torch.optim.Adam, lr=args.lr)
    runs = [("CNN, 1 node", 1, SimpleReduceStrategy(adam)), ("CNN, DDP on 4 nodes", 4, SimpleReduceStrategy(adam)),
            ("CNN, DiLoCo H=50 on 4", 4, DiLoCoStrategy(adam, H=50))]
    print(f"MNIST-1D: {len(train)} train / {len(test)} test; {args.steps} steps of 100 examples per run\n")
    rows = []
    for label, nodes, strategy in runs:
        torch.manual_seed(args.seed)
        trainer = Trainer(Conv1dNet(), train, test)
        start = time.perf_counter()
        trainer.fit(strategy, nodes, max_steps=args.steps, batch_size=100 // nodes, val_size=len(test),
                    val_interval=args.steps, seed=args.seed, device="cpu", progress=True, logger=False)
        acc = trainer.record.val[-1]["global_accuracy"]
        rows.append((label, acc, trainer.record.bytes_per_node[0], time.perf_counter() - start))
        print(f"{label:<24} test accuracy {acc:.1%}  ({rows[-1][3]:.0f} s)", flush=True)

    print(f"\n| {'model':<24} | test accuracy | MB sent per node | source |")
    print(f"|{'-' * 26}|---------------|------------------|--------|")
    for name, acc in PAPER.items():
        print(f"| {name:<24} | {acc:13.0%} | {'-':>16} | paper  |")
    for label, acc, sent, _ in rows:
        print(f"| {label:<24} | {acc:13.1%} | {sent / 1e6:16.2f} | here   |")
    args.out.write_text(json.dumps({
        "command": "python examples/mnist1d.py" + (" --update-docs" if args.update_docs else ""),
        "steps": args.steps, "seed": args.seed, "paper": PAPER,
        "runs": [{"label": label, "test_accuracy": acc, "wire_bytes_per_node": sent, "seconds": round(sec, 1)}
                 for label, acc, sent, sec in rows]}, indent=1) + "\n")
    print_outputs([args.out])


if __name__ == "__main__":
    main()
