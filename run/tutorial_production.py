"""Tutorial 4 (advanced): from a simulation to a run you can stop, resume, time and move to real machines.

    python run/tutorial_production.py [--steps 100] [--out runs/tutorial_production]

- Run folders: each fit writes <out>/logs/<run_name>/ (config.json, train.csv, val.csv, summary.json).
- Checkpoints: checkpoint_interval=N saves every node's full state; resume_from continues exactly, so a run
  cut in two ends bit-identical to one that never stopped (checked below).
- Simulated time: network="home" (100 Mbit/s, 30 ms) prices every collective; record.sim_time_s is what the
  run would take on that network.
- Real processes: backend="torch" runs the same strategy with one process per node over torch.distributed
  (here spawned locally, 2 nodes); under torchrun the same script runs across machines:
  torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from _toy import MLP, points
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy


def _trainer() -> Trainer:
    torch.manual_seed(0)
    return Trainer(MLP(), points(2048, seed=1), points(256, seed=2))


def main(steps: int = 100, out: Path = Path("runs/tutorial_production"), real_processes: bool = True) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # logs/ and checkpoints/ go under --out
    try:
        common = dict(batch_size=32, val_interval=steps, progress=False, network="home")
        whole = _trainer().fit(DiLoCoStrategy(lr=3e-3, H=10), 4, max_steps=steps, run_name="whole", **common)
        half = steps // 2
        _trainer().fit(DiLoCoStrategy(lr=3e-3, H=10), 4, max_steps=steps, run_name="first-half",
                       checkpoint_interval=half, **common)  # saves at step `half` (and at the end)
        trainer = _trainer()
        resumed = trainer.fit(DiLoCoStrategy(lr=3e-3, H=10), 4, max_steps=steps, run_name="resumed",
                              resume_from=f"logs/first-half/checkpoints/step_{half:09d}", **common)
        same = all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), resumed.state_dict().values()))
        print(f"run folders: {sorted(os.listdir('logs'))} under {out}")
        print(f"resumed from step {half}: bit-identical to the uninterrupted run: {same}")
        print(f"simulated time on a home network (100 Mbit/s, 30 ms): {trainer.record.sim_time_s:.2f} s")
        result = {"identical": same, "sim_time_s": trainer.record.sim_time_s}
        if real_processes:
            procs = _trainer()
            procs.fit(DiLoCoStrategy(lr=3e-3, H=10), 2, max_steps=steps, batch_size=32, backend="torch",
                      progress=False, logger=False)
            print(f"backend='torch', 2 processes: final validation loss {procs.record.val[-1]['global_loss']:.3f}")
        return result
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("runs/tutorial_production"))
    args = parser.parse_args()
    main(args.steps, args.out)
