"""Heterogeneous workers on a WAN: synchronous DiLoCo against asynchronous and decentralized training.

    python examples/async_heterogeneous.py                 # MNIST, 4 nodes, per-step 0.58/0.75/1.51/3.33 s
    python examples/async_heterogeneous.py --rounds 10     # shorter
    python examples/async_heterogeneous.py --update-docs   # the default run, its JSON and plots into docs/img

Four nodes whose steps take 0.58, 0.75, 1.51 and 3.33 simulated seconds (the async Local-SGD paper's toy study,
arXiv:2401.09135, sec. 5), linked by a WAN (--bandwidth, --latency; each transfer costed alone, as these tables were
measured: --shared-links shares the links among the transfers in flight), train an MLP on MNIST with AdamW inner
steps (batch 32 per node). Synchronous DiLoCo runs --rounds rounds of H steps: every round waits for the slowest
node. Every strategy uses its paper's outer settings (outer lr 0.7, Nesterov 0.9); the plain asynchronous ones
also run at outer lr 0.1 (the best of 0.7, 0.35, 0.2, 0.1 on a 5-round run). The asynchronous strategies get the
same simulated time (--budget-factor x DiLoCo's) and train until a
node's clock reaches it (time_budget_s), so fast nodes take more steps. Printed: loss against server updates
and against simulated time, the final validation loss at that time, each node's steps, and goodput (compute
over 4 x the run's time). Then the goodput of DiLoCo and Decoupled DiLoCo under seeded random failures.
Numbers to runs/async_heterogeneous.json (--out to move it; --update-docs: docs/img), plots beside it.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from exogym import Trainer
from exogym.cluster.membership import RandomFailures
from exogym.cluster.network import Network
from exogym.data.mnist import load_mnist
from exogym.models import MLPClassifier
from exogym.strategy import (AsyncDiLoCoStrategy, DecoupledDiLoCoStrategy, DiLoCoStrategy, FedBuffStrategy,
                             GossipStrategy, OptimSpec)
from published_output import add_update_docs, output_path, print_outputs

STEP_SECONDS = (0.58, 0.75, 1.51, 3.33)
BATCH = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="synchronous DiLoCo's rounds (default 30)")
    parser.add_argument("--H", type=int, default=20, help="inner steps per round (default 20)")
    parser.add_argument("--bandwidth", default="10Mbps")
    parser.add_argument("--shared-links", action="store_true",
                        help="share the links among the transfers in flight (exogym.cluster.flows); by default each "
                             "transfer is costed alone, Network(shared_links=False), as the published tables were")
    parser.add_argument("--latency", default="50ms")
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's learning rate")
    parser.add_argument("--budget-factor", type=float, default=1.0,
                        help="the asynchronous runs' simulated time as a multiple of DiLoCo's (default 1)")
    parser.add_argument("--failure-rate", type=float, default=0.01, help="per node per step (default 0.01)")
    parser.add_argument("--out", default=None, help="the JSON file (default runs/async_heterogeneous.json)")
    add_update_docs(parser, "async_heterogeneous.json and its two plots")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "async_heterogeneous.json", given=args.out)
    return args


def step_flops(model: torch.nn.Module, batch) -> float:
    """FLOPs of one forward/backward (what the sim counts)."""
    with FlopCounterMode(display=False) as counter:
        model(batch)["loss"].backward()
    model.zero_grad()
    return float(counter.get_total_flops())


def strategies(args, budget: float) -> list[tuple[str, object, dict]]:
    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr)
    sync_steps = args.rounds * args.H
    budget_steps = math.ceil(budget / STEP_SECONDS[0]) + args.H  # enough for the fastest node to fill the budget
    timed = dict(time_budget_s=budget)
    return [
        ("sync DiLoCo", DiLoCoStrategy(adamw, H=args.H), dict(max_steps=sync_steps)),
        ("async DiLoCo", AsyncDiLoCoStrategy(adamw, H=args.H, **timed), dict(max_steps=budget_steps)),
        ("async DiLoCo, outer lr 0.1", AsyncDiLoCoStrategy(adamw, H=args.H, outer_lr=0.1, **timed),
         dict(max_steps=budget_steps)),
        # Delayed Nesterov as ExoGym first read it (each pseudo-gradient at full size), the row published in
        # docs/results.md sec. 7; the paper's Algorithm 3 (delayed_nesterov=True) is in examples/async_toy_study.py
        ("async DiLoCo + DN + DLU", AsyncDiLoCoStrategy(adamw, H=args.H, delayed_nesterov="full_steps",
                                                        dynamic_local_updates=True, **timed),
         dict(max_steps=budget_steps)),
        ("Decoupled DiLoCo", DecoupledDiLoCoStrategy(adamw, H=args.H, min_quorum=2, **timed),
         dict(max_steps=budget_steps)),
        ("Decoupled DiLoCo, outer lr 0.1", DecoupledDiLoCoStrategy(adamw, H=args.H, min_quorum=2, outer_lr=0.1,
                                                                   **timed), dict(max_steps=budget_steps)),
        ("FedBuff K=2", FedBuffStrategy(adamw, H=args.H, buffer_size=2, **timed), dict(max_steps=budget_steps)),
        ("gossip ring async", GossipStrategy(adamw, topology="ring", mode="async", H=args.H // 4, **timed),
         dict(max_steps=budget_steps)),
    ]


def updates_at(label: str, row: dict, H: int) -> float | None:
    """Server updates applied when a validation row was taken (DiLoCo: its rounds; gossip: none)."""
    if "updates" in row:
        return row["updates"]
    return row["step"] // H if label == "sync DiLoCo" else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    network = Network(bandwidth=args.bandwidth, latency=args.latency, shared_links=args.shared_links)
    train, test = load_mnist("train"), load_mnist("test")
    torch.manual_seed(0)
    flops = step_flops(MLPClassifier(784, 10, hidden=128), (train.tensors[0][:BATCH], train.tensors[1][:BATCH]))
    speeds = [STEP_SECONDS[0] / s for s in STEP_SECONDS]
    device_flops = flops / STEP_SECONDS[0]  # node 0's step takes 0.58 s; node i's STEP_SECONDS[i]
    common = dict(batch_size=BATCH, val_size=1000, device="cpu", network=network, node_speeds=speeds,
                  device_flops=device_flops, logger=False, progress=False)
    print(f"4 nodes, per-step {list(STEP_SECONDS)} s, on {network}; MLP 784-128-10 on MNIST, AdamW lr {args.lr}, "
          f"H={args.H}, batch {BATCH} per node\n", flush=True)

    results, budget = [], None
    for label, strategy, fit in strategies(args, budget=1.0):
        if budget is not None:  # the asynchronous runs: rebuilt with the budget DiLoCo's run sets
            strategy = dict((n, s) for n, s, _ in strategies(args, budget))[label]
            fit = dict((n, f) for n, _, f in strategies(args, budget))[label]
        torch.manual_seed(0)
        trainer = Trainer(MLPClassifier(784, 10, hidden=128), train, test)
        interval = args.H if label == "sync DiLoCo" else max(args.H, fit["max_steps"] // 30)
        trainer.fit(strategy, 4, val_interval=interval, **fit, **common)
        r = trainer.record
        if budget is None:
            budget = r.sim_time_s * args.budget_factor
        curve = [{"sim_time_s": v.get("sim_time_s", _sim_at(r, v["step"])), "updates": updates_at(label, v, args.H),
                  "global_loss": v["global_loss"]} for v in r.val]
        steps = [sum(1 for x in row if x == x) for row in r.node_loss]
        results.append({"label": label, "final_val_loss": r.val[-1]["global_loss"],
                        "final_val_accuracy": r.val[-1]["global_accuracy"], "sim_time_s": r.sim_time_s,
                        "updates": len(r.updates) if r.updates else (args.rounds if label == "sync DiLoCo" else None),
                        "steps_per_node": steps, "goodput": r.goodput, "curve": curve,
                        "bytes_per_node": r.bytes_per_node})
        print(f"{label:<24} val loss {results[-1]['final_val_loss']:.4f} at {r.sim_time_s:7.1f} s; steps per node "
              f"{steps}; goodput {r.goodput:.2f}", flush=True)

    print("\n| run | final val loss | accuracy | simulated s | server updates | steps per node | goodput |")
    print("|---|---|---|---|---|---|---|")
    for x in results:
        print(f"| {x['label']} | {x['final_val_loss']:.4f} | {x['final_val_accuracy']:.2%} | {x['sim_time_s']:.1f} | "
              f"{x['updates'] if x['updates'] is not None else '-'} | {x['steps_per_node']} | {x['goodput']:.2f} |")

    marks = [budget / 4, budget / 2, budget]
    print("\nLoss against simulated time (the last evaluation at or before each time) and against updates (the first "
          f"evaluation after {args.rounds} updates: sync DiLoCo's rounds; gossip has none):\n")
    print("| run | " + " | ".join(f"loss at {t:.0f} s" for t in marks) + f" | loss after {args.rounds} updates |")
    print("|---|" + "---|" * (len(marks) + 1))
    for x in results:
        at = [loss_at(x["curve"], "sim_time_s", t, before=True) for t in marks]
        after = loss_at(x["curve"], "updates", args.rounds, before=False)
        print(f"| {x['label']} | " + " | ".join(_fmt(v) for v in at) + f" | {_fmt(after)} |")
        x["loss_at_s"] = dict(zip((f"{t:.0f}" for t in marks), at))
        x["loss_after_updates"] = after

    print(f"\nUnder failures (each node fails at each step with probability {args.failure_rate}, down 20 steps, "
          "seed 0):\n\n| run | final val loss | simulated s | goodput |\n|---|---|---|---|")
    failures = []
    for label, strategy, fit in strategies(args, budget):
        if label not in ("sync DiLoCo", "Decoupled DiLoCo, outer lr 0.1"):
            continue
        torch.manual_seed(0)
        trainer = Trainer(MLPClassifier(784, 10, hidden=128), train, test)
        trainer.fit(strategy, 4, val_interval=fit["max_steps"], failures=RandomFailures(args.failure_rate, 20, 0),
                    **fit, **common)
        r = trainer.record
        failures.append({"label": label, "final_val_loss": r.val[-1]["global_loss"], "sim_time_s": r.sim_time_s,
                         "goodput": r.goodput})
        print(f"| {label} | {r.val[-1]['global_loss']:.4f} | {r.sim_time_s:.1f} | {r.goodput:.2f} |", flush=True)

    out.write_text(json.dumps({
        "command": "python examples/async_heterogeneous.py" + (" --update-docs" if args.update_docs else ""),
        "step_seconds": STEP_SECONDS, "network": str(network), "H": args.H, "rounds": args.rounds,
        "budget_s": budget, "runs": results, "failures": failures}, indent=1) + "\n")
    written = [out]
    try:
        written += plot(results, out)
    except ImportError:
        print("\n(install matplotlib for the plots: pip install 'exogym[plot]')")
    print_outputs(written)


def loss_at(curve: list[dict], key: str, mark: float, *, before: bool) -> float | None:
    """The validation loss of the last evaluation with key <= mark (before=True), or of the first with key >= mark."""
    points = [p for p in curve if p[key] is not None]
    if before:
        chosen = [p for p in points if p[key] <= mark + 1e-9]
        return chosen[-1]["global_loss"] if chosen else None
    chosen = [p for p in points if p[key] >= mark]
    return chosen[0]["global_loss"] if chosen else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _sim_at(record, step: int) -> float:
    rows = {int(r["step"]): r["sim_time_s"] for r in record.train}
    return rows.get(int(step), 0.0)


def plot(results: list[dict], out) -> list:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    written = []
    for x_key, name, label in (("sim_time_s", "async_loss_vs_time.png", "simulated seconds"),
                               ("updates", "async_loss_vs_updates.png", "server updates (DiLoCo: rounds)")):
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, run in enumerate(results):
            points = [(p[x_key], p["global_loss"]) for p in run["curve"] if p[x_key] is not None]
            if points:
                ax.plot(*zip(*points), label=run["label"], marker="osD^vP*X"[i % 8], markersize=4, fillstyle="none")
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (global model)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        path = out.with_name(name)
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
