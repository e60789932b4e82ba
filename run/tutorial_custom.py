"""Tutorial 3 (advanced): your own distributed algorithm, two ways.

    python run/tutorial_custom.py [--steps 200]

1. Subclass Strategy and write step(). The helpers are thin calls into exogym.strategy.communicate:
   communicate_gradients() averages the gradients over the nodes (an all-reduce), communicate_models() the
   parameters, update_parameters() clips and steps the optimizer (self.optim, alias self.optimizer). Below:
   local SGD, which averages gradients on even steps and models every 10 steps.
2. Compose communication modules: CommunicateOptimizeStrategy([SparseCommunicator(...),
   DiLoCoCommunicator(H=...)]) takes an inner optimizer step, then lets each module communicate on its own
   schedule (this one is SPARTA-DiLoCo).
"""

from __future__ import annotations

import argparse

import torch

from _toy import train_on_points
from exogym.strategy import CommunicateOptimizeStrategy, DiLoCoCommunicator, OptimSpec, SparseCommunicator, Strategy


class EveryOtherStep(Strategy):
    """Average gradients on even steps, take purely local steps on odd ones, and average the models every 10."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)  # optim_spec, lr_scheduler, max_norm, ... are the base class's

    def step(self):
        if self.local_step % 2 == 0:
            self.communicate_gradients()
        self.update_parameters()
        if (self.local_step + 1) % 10 == 0:
            self.communicate_models()
        super().step()  # the LR schedule and the step count


def main(steps: int = 200) -> list[tuple[str, float, int]]:
    rows = []
    for name, strategy in [
        ("EveryOtherStep", EveryOtherStep(optim_spec=OptimSpec(torch.optim.AdamW, lr=3e-3), max_norm=1.0)),
        ("SPARTA + DiLoCo", CommunicateOptimizeStrategy([SparseCommunicator(p_sparta=0.01), DiLoCoCommunicator(H=20)],
                                                        inner_optim="adamw", lr=3e-3)),
    ]:
        loss, sent = train_on_points(strategy, steps)
        rows.append((name, loss, sent))
        print(f"{name:<16} validation loss {loss:.3f}   sent per node {sent / 1e6:.3f} MB", flush=True)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
