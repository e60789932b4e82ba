"""Federated MNIST in the FedAvg paper's setting: communication rounds to 99% test accuracy.

    python examples/federated_mnist.py --quick                 # a smoke run (about a minute)
    python examples/federated_mnist.py                         # the grid, at most --max-rounds rounds each
    python examples/federated_mnist.py --configs iid-e5=30 noniid-e1=10   # chosen configs, own round budgets

McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data": 100
clients of 600 training digits, either IID (a fixed random split) or the paper's pathological non-IID
split (sorted by label, 200 shards of 300, two per client: fit(partition="shards")). Each round C=0.1 of
the clients (10, sampled with a shared seed) train E local epochs of plain SGD at batch B from the global
model, which becomes their average: FedAvgStrategy(client_sampling=0.1, local_epochs=E). The model is the
paper's CNN (FedAvgCNN, 1,663,370 parameters). After every round the global model is scored on the
10,000 test digits. A configuration runs in chunks of --check-every rounds (each chunk resumes from the
last one's checkpoint, exactly as if it never stopped) and stops once it reaches the target accuracy or
its round budget. Printed: rounds to the target next to the paper's (its Table 2, CNN), the MB each
client sent up to then (the mean over the 100 clients of what they send: a ring all-reduce among the
round's clients, or within each island, plus the new model handed to the next round's newcomers; what
a client receives is not counted), and the wall time. Saved under --out: results.json (accuracy after
every round) and a plot of test error against rounds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from exogym import Trainer
from exogym.data.mnist import load_mnist
from exogym.models import FedAvgCNN
from exogym.strategy import FedAvgStrategy, OptimSpec

NUM_CLIENTS, CLIENT_FRACTION = 100, 0.1


@dataclass(frozen=True)
class Setting:
    label: str
    local_epochs: int  # E
    batch_size: int  # B
    non_iid: bool
    island_size: int | None = None
    paper_rounds: int | None = None  # McMahan et al. 2017, Table 2 (CNN, 99%, C=0.1)


CONFIGS = {
    "iid-e5": Setting("E=5 B=10, IID", 5, 10, False, paper_rounds=20),
    "iid-e1": Setting("E=1 B=10, IID", 1, 10, False, paper_rounds=34),
    "noniid-e5": Setting("E=5 B=10, non-IID", 5, 10, True, paper_rounds=229),
    "noniid-e1": Setting("E=1 B=10, non-IID", 1, 10, True, paper_rounds=350),
    "iid-e1-islands5": Setting("E=1 B=10, IID, islands of 5", 1, 10, False, island_size=5),
    "noniid-e1-islands5": Setting("E=1 B=10, non-IID, islands of 5", 1, 10, True, island_size=5),
}


def iid_clients(train: TensorDataset, seed: int):
    """A dataset factory: client r keeps the same 600 random digits for the whole run, as in the paper
    (fit's default sharding would deal every client a fresh 600 each epoch)."""
    images, labels = train.tensors
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))

    def client(rank: int, num_nodes: int, is_val: bool) -> TensorDataset:
        idx = order[rank::num_nodes]  # [600]
        return TensorDataset(images[idx], labels[idx])
    return client


def run(name: str, s: Setting, train: TensorDataset, test: TensorDataset, *, lr: float, max_rounds: int,
        check_every: int, target: float, val_size: int, seed: int, device: str, out: Path) -> dict:
    """Train one configuration until `target` accuracy or `max_rounds`; its per-round accuracy and bytes."""
    steps_per_round = s.local_epochs * (len(train) // NUM_CLIENTS // s.batch_size)  # H = E x steps per epoch
    torch.manual_seed(seed)  # the same initial model in every configuration
    trainer = Trainer(FedAvgCNN(), train if s.non_iid else iid_clients(train, seed), test)
    strategy = FedAvgStrategy(OptimSpec(torch.optim.SGD, lr=lr), client_sampling=CLIENT_FRACTION,
                              local_epochs=s.local_epochs, island_size=s.island_size, seed=seed)
    checkpoints = out / "checkpoints" / name
    shutil.rmtree(checkpoints, ignore_errors=True)
    start, rounds, accuracy = time.perf_counter(), 0, []
    while rounds < max_rounds and not any(a >= target for a in accuracy):
        rounds = min(rounds + check_every, max_rounds)
        trainer.fit(strategy, NUM_CLIENTS, max_steps=rounds * steps_per_round, batch_size=s.batch_size,
                    val_size=val_size, val_interval=steps_per_round, seed=seed, device=device, progress=True,
                    logger=False, partition="shards" if s.non_iid else "iid",
                    checkpoint_interval=rounds * steps_per_round, checkpoint_dir=checkpoints, keep_checkpoints=1,
                    resume_from=checkpoints if accuracy else None)
        accuracy = [row["global_accuracy"] for row in trainer.record.val if row["step"] > 0]  # per round, from 1
        print(f"  {name}: round {rounds:4d}  test accuracy {accuracy[-1]:.2%}  "
              f"({time.perf_counter() - start:6.0f} s)", flush=True)
    shutil.rmtree(checkpoints, ignore_errors=True)
    reached = next((r for r, a in enumerate(accuracy, 1) if a >= target), None)
    upto = reached or len(accuracy)
    sent = next(row["bytes"] for row in trainer.record.train if row["step"] == upto * steps_per_round)  # per client
    return {"name": name, "label": s.label, "rounds_run": len(accuracy), "rounds_to_target": reached,
            "accuracy": accuracy, "mb_per_client": sent / 1e6, "paper_rounds": s.paper_rounds,
            "lr": lr, "max_rounds": max_rounds, "wall_time_s": time.perf_counter() - start,
            "s_per_round": (time.perf_counter() - start) / len(accuracy)}


def table(results: list[dict], target: float) -> str:
    lines = [f"| config | rounds to {target:.0%} | test accuracy | paper's rounds | MB sent per client | wall s |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r["rounds_to_target"] is not None:
            rounds, acc = str(r["rounds_to_target"]), r["accuracy"][r["rounds_to_target"] - 1]
        else:
            n = r["rounds_run"]
            rounds, acc = f"not in {n} round{'s' * (n != 1)} (best {max(r['accuracy']):.2%})", r["accuracy"][-1]
        paper = "-" if r["paper_rounds"] is None else str(r["paper_rounds"])
        lines.append(f"| {r['label']} | {rounds} | {acc:.2%} | {paper} | {r['mb_per_client']:.1f} | "
                     f"{r['wall_time_s']:.0f} |")
    return "\n".join(lines)


def plot(results: list[dict], target: float, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(install matplotlib for the plot: pip install 'exogym[plot]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:  # test error on a log scale: 90% and 99% accuracy are both readable
        ax.plot(range(1, len(r["accuracy"]) + 1), [1 - a for a in r["accuracy"]], marker=".", label=r["label"])
    ax.axhline(1 - target, color="grey", linestyle="--", linewidth=0.8, label=f"{target:.0%} accuracy")
    ax.set(xlabel="communication round", ylabel="test error of the global model (1 - accuracy)", yscale="log",
           title=f"FedAvg on MNIST, {NUM_CLIENTS} clients, C={CLIENT_FRACTION}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


def parse_config(text: str) -> tuple[str, int | None]:
    """'name' or 'name=ROUNDS' (that configuration's own round budget)."""
    name, _, rounds = text.partition("=")
    if name not in CONFIGS:
        raise argparse.ArgumentTypeError(f"unknown config {name!r}; choose from {sorted(CONFIGS)}")
    if rounds and not (rounds.isdigit() and int(rounds) >= 1):
        raise argparse.ArgumentTypeError(f"the round budget in {text!r} must be an int >= 1")
    return name, int(rounds) if rounds else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=parse_config, default=[(n, None) for n in list(CONFIGS)[:5]],
                        metavar="NAME[=ROUNDS]", help=f"configurations to run (default: the first five of "
                        f"{', '.join(CONFIGS)})")
    parser.add_argument("--max-rounds", type=int, default=100, help="round budget of a config without its own")
    parser.add_argument("--check-every", type=int, default=5, help="rounds between checks of the target")
    parser.add_argument("--target", type=float, default=0.99)
    # Of 0.05, 0.1 and 0.2 tried for 2 rounds, 0.05 led on the non-IID split and tied 0.1 on IID; 0.2 lagged.
    parser.add_argument("--lr", type=float, default=0.05, help="client SGD learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None,
                        help="results.json and the plot (default runs/federated_mnist, or runs/federated_mnist_quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: E=1, IID for 2 rounds (checked after each) and non-IID for 1, scored on "
                             "1000 test digits")
    args = parser.parse_args()
    if args.max_rounds < 1 or args.check_every < 1 or not 0 < args.target <= 1:
        parser.error(f"need --max-rounds >= 1, --check-every >= 1 and 0 < --target <= 1; got {args.max_rounds}, "
                     f"{args.check_every}, {args.target}")
    val_size = 10_000
    if args.quick:
        args.configs, args.check_every, val_size = [("iid-e1", 2), ("noniid-e1", 1)], 1, 1000

    args.out = args.out or Path("runs/federated_mnist_quick" if args.quick else "runs/federated_mnist")
    train, test = load_mnist("train"), load_mnist("test")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"MNIST: {NUM_CLIENTS} clients x {len(train) // NUM_CLIENTS} digits, {CLIENT_FRACTION:.0%} per round, "
          f"SGD lr {args.lr}; validation on {min(val_size, len(test))} test digits after every round\n", flush=True)
    results = []
    for name, rounds in args.configs:
        results.append(run(name, CONFIGS[name], train, test, lr=args.lr, max_rounds=rounds or args.max_rounds,
                           check_every=args.check_every, target=args.target, val_size=val_size, seed=args.seed,
                           device=args.device, out=args.out))
        (args.out / "results.json").write_text(json.dumps(results, indent=1))  # kept as each config ends
    print("\n" + table(results, args.target))
    plot(results, args.target, args.out / "accuracy_vs_rounds.png")


if __name__ == "__main__":
    main()
