"""Tutorial 2 (intermediate): the same task under every built-in strategy; loss against bytes sent.

    python run/tutorial_strategies.py [--steps 200]

Each strategy trades communication for agreement between the nodes: DDP averages gradients every step,
DiLoCo averages parameter changes every H steps (then an outer Nesterov step), SPARTA averages a random
fraction p of the parameters every step, FedAvg averages models every H steps, DeMo sends only the fast
components of each node's momentum. Every run starts from the same weights and sees the same examples.
"""

from __future__ import annotations

import argparse

import torch

from _toy import train_on_points
from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy,
                             SPARTAStrategy)


def main(steps: int = 200) -> list[tuple[str, float, int]]:
    adamw = OptimSpec(torch.optim.AdamW, lr=3e-3)
    runs = [("DDP", SimpleReduceStrategy(optim_spec=adamw)),
            ("DiLoCo H=20", DiLoCoStrategy(optim_spec=adamw, H=20)),
            ("SPARTA p=0.01", SPARTAStrategy(optim_spec=adamw, p_sparta=0.01)),
            ("FedAvg H=10", FedAvgStrategy(optim_spec=adamw, H=10)),
            ("DeMo", DeMoStrategy(lr=3e-3, compression_topk=8))]
    rows = []
    print("| strategy | validation loss (global model) | MB sent per node |\n|---|---|---|")
    for name, strategy in runs:
        loss, sent = train_on_points(strategy, steps)
        rows.append((name, loss, sent))
        print(f"| {name} | {loss:.3f} | {sent / 1e6:.3f} |", flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
