"""`python run/cifar10_comparison.py [--data PATH]`: DDP, DiLoCo, SPARTA, FedAvg and DeMo on CIFAR-10.

The runs of examples/mnist.py (4 nodes, global batch 128, every run from the same initial weights) on a small
CNN for 32x32 colour images; printed per run: the global model's test loss and accuracy, the bytes each node
sent, the wall time. CIFAR-10 is read from a local copy, never downloaded: get the "CIFAR-10 python version"
(cifar-10-python.tar.gz) from https://www.cs.toronto.edu/~kriz/cifar.html, `tar xzf` it, and pass the
cifar-10-batches-py folder (or the folder holding it) with --data, or put it under $EXOGYM_DATA
(default ~/.cache/exogym).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from _examples import load_example
from exogym import Trainer
from exogym.data.cifar10 import load_cifar10


class CifarCNN(nn.Module):
    """Two conv blocks and a linear head for [B, 3, 32, 32] images; model(batch) -> {"loss", "accuracy"}."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # [B, 32, 16, 16]
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # [B, 64, 8, 8]
        )
        self.head = nn.Linear(64 * 8 * 8, num_classes)

    def forward(self, batch):
        x, y = batch
        logits = self.head(self.features(x).flatten(1))
        return {"loss": F.cross_entropy(logits, y), "accuracy": (logits.argmax(1) == y).float().mean()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(os.environ.get("EXOGYM_DATA", "~/.cache/exogym")))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    try:
        train, test = load_cifar10(args.data, "train"), load_cifar10(args.data, "test")
    except RuntimeError as e:  # not there or not CIFAR-10: the message says how to get it
        sys.exit(str(e))
    mnist = load_example("mnist")  # the same strategies and evaluation as the MNIST comparison
    print(f"CIFAR-10: {len(train):,} training and {len(test):,} test images; {args.steps} steps of "
          f"{mnist.GLOBAL_BATCH} examples per run\n")
    for label, nodes, strategy in mnist.strategies(args.lr):
        torch.manual_seed(args.seed)
        trainer = Trainer(CifarCNN(), train, test)
        start = time.perf_counter()
        model = trainer.fit(strategy, nodes, max_steps=args.steps, batch_size=mnist.GLOBAL_BATCH // nodes,
                            val_size=1000, val_interval=max(1, args.steps // 10), seed=args.seed, device=args.device,
                            progress=False, logger=False)
        loss, acc = mnist.evaluate(model, test)
        print(f"{label:<16} test loss {loss:.4f}  accuracy {acc:.2%}  sent/node "
              f"{trainer.record.bytes_per_node[0] / 1e6:8.2f} MB  {time.perf_counter() - start:6.1f} s", flush=True)


if __name__ == "__main__":
    main()
