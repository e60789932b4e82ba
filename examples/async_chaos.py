"""Heterogeneous workers under transient slowdowns ("chaos"): synchronous DiLoCo against asynchronous DiLoCo and
Decoupled DiLoCo.

    python examples/async_chaos.py                  # MNIST, 4 nodes, the setting of examples/async_heterogeneous.py
    python examples/async_chaos.py --rounds 5       # shorter

The setting of examples/async_heterogeneous.py (docs/results.md section 7): four nodes whose steps take 0.58, 0.75,
1.51 and 3.33 simulated seconds on a 10 Mbit/s, 50 ms WAN (each transfer costed alone) train an MLP 784-128-10 on MNIST (AdamW inside, batch 32
per node, H = 20). On top, every node is slowed now and then, drawn from a seed: RandomSlowdowns(rate, factor,
duration, seed) (by default one slowdown per node every 200 simulated seconds on average, each 20 to 60 s long,
2 to 5 times slower). Synchronous DiLoCo runs --rounds rounds; every other run gets the simulated time DiLoCo took
under the same slowdowns (time_budget_s) and trains until then. Printed: each run's final validation loss, its
simulated time, the slowdowns the nodes met and the time they added (slowed_s), each node's steps, server updates
and goodput (useful compute over 4 x the run's time: time lost to slowdowns and waiting is not useful).
"""

from __future__ import annotations

import argparse

import torch

from async_heterogeneous import BATCH, STEP_SECONDS, step_flops
from exogym import RandomSlowdowns, Trainer
from exogym.cluster.network import Network
from exogym.data.mnist import load_mnist
from exogym.models import MLPClassifier
from exogym.strategy import AsyncDiLoCoStrategy, DecoupledDiLoCoStrategy, DiLoCoStrategy, OptimSpec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30, help="synchronous DiLoCo's rounds (default 30)")
    parser.add_argument("--H", type=int, default=20, help="inner steps per round (default 20)")
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's learning rate")
    parser.add_argument("--rate", type=float, default=1 / 200, help="slowdowns per node per simulated second")
    parser.add_argument("--factor", type=float, nargs=2, default=(2.0, 5.0), help="slowdown factor range")
    parser.add_argument("--duration", type=float, nargs=2, default=(20.0, 60.0), help="slowdown length range, s")
    parser.add_argument("--seed", type=int, default=0, help="the slowdowns' seed")
    parser.add_argument("--no-baseline", action="store_true", help="skip the runs without slowdowns")
    return parser.parse_args(argv)


def runs(args, budget: float) -> list[tuple[str, object, int]]:
    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr)
    steps = int(budget / STEP_SECONDS[0]) + args.H  # enough for the fastest node to fill the budget
    timed = dict(time_budget_s=budget)
    return [
        ("async DiLoCo, outer lr 0.1", AsyncDiLoCoStrategy(adamw, H=args.H, outer_lr=0.1, **timed), steps),
        # Delayed Nesterov as ExoGym first read it (each pseudo-gradient at full size), the row published in
        # docs/results.md sec. 7; the paper's Algorithm 3 (delayed_nesterov=True) is in examples/async_toy_study.py
        ("async DiLoCo + DN + DLU", AsyncDiLoCoStrategy(adamw, H=args.H, delayed_nesterov="full_steps",
                                                        dynamic_local_updates=True, **timed), steps),
        ("Decoupled DiLoCo, outer lr 0.1", DecoupledDiLoCoStrategy(adamw, H=args.H, min_quorum=2, outer_lr=0.1,
                                                                   **timed), steps),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    network = Network(bandwidth="10Mbps", latency="50ms", shared_links=False)  # section 7's: each transfer alone
    train, test = load_mnist("train"), load_mnist("test")
    torch.manual_seed(0)
    flops = step_flops(MLPClassifier(784, 10, hidden=128), (train.tensors[0][:BATCH], train.tensors[1][:BATCH]))
    common = dict(batch_size=BATCH, val_size=1000, device="cpu", network=network,
                  node_speeds=[STEP_SECONDS[0] / s for s in STEP_SECONDS], device_flops=flops / STEP_SECONDS[0],
                  logger=False, progress=False)
    chaos = RandomSlowdowns(args.rate, tuple(args.factor), tuple(args.duration), args.seed)
    print(f"4 nodes, per-step {list(STEP_SECONDS)} s, on {network}; MLP 784-128-10 on MNIST, H={args.H}; "
          f"{chaos}\n", flush=True)

    def fit(label, strategy, max_steps, slowdowns):
        torch.manual_seed(0)
        trainer = Trainer(MLPClassifier(784, 10, hidden=128), train, test)
        trainer.fit(strategy, 4, max_steps=max_steps, val_interval=max_steps, slowdowns=slowdowns, **common)
        r = trainer.record
        row = {"label": label + (", slowdowns" if slowdowns is not None else ""), "loss": r.val[-1]["global_loss"],
               "sim_time_s": r.sim_time_s, "slowdowns": len(r.slowdowns),
               "slowed_s": sum(t.get("slowed_s", 0.0) for t in r.time_per_node),
               "idle_s": sum(t["idle_s"] for t in r.time_per_node),
               "steps": [sum(1 for x in row if x == x) for row in r.node_loss],
               "updates": len(r.updates) if r.updates else args.rounds, "goodput": r.goodput}
        print(f"{row['label']:<40} val loss {row['loss']:.4f} at {row['sim_time_s']:7.1f} s; goodput "
              f"{row['goodput']:.2f}; steps {row['steps']}", flush=True)
        return row

    rows = []
    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr)
    for slowdowns in ([None] if not args.no_baseline else []) + [chaos]:
        sync = fit("sync DiLoCo", DiLoCoStrategy(adamw, H=args.H), args.rounds * args.H, slowdowns)
        rows.append(sync)
        for label, strategy, steps in runs(args, sync["sim_time_s"]):
            if slowdowns is None and "Decoupled" not in label:
                continue  # without slowdowns: docs/results.md section 7 has the others
            rows.append(fit(label, strategy, steps, slowdowns))

    print("\n| run | final val loss | simulated s | slowdowns met | slowed s (all nodes) | idle s (all nodes) | "
          "server updates | steps per node | goodput |")
    print("|---|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['label']} | {x['loss']:.4f} | {x['sim_time_s']:.1f} | {x['slowdowns']} | {x['slowed_s']:.1f} | "
              f"{x['idle_s']:.1f} | {x['updates']} | {x['steps']} | {x['goodput']:.2f} |")


if __name__ == "__main__":
    main()
