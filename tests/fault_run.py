"""A small checkpointed run that a fault-injection test stops at a chosen step (python fault_run.py KIND STEP):
node 1 reads its step-STEP batch and then raises, or sends its process SIGINT, SIGTERM or SIGKILL. KIND "none"
runs it whole. The run writes logs/r/ in the working folder."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from exogym import Trainer  # noqa: E402
from exogym.strategy import DiLoCoStrategy  # noqa: E402
from exogym.strategy.optim import OptimSpec  # noqa: E402
from faulty import FailOnNode  # noqa: E402
from toy import TinyMLP  # noqa: E402

MAX_STEPS, CHECKPOINT_INTERVAL, BATCH = 30, 4, 16


def fit(kind: str = "none", step: int = 0, **kwargs):
    data = FailOnNode(1, BATCH * (step - 1), kind) if kind != "none" else FailOnNode(1, -1)
    trainer = Trainer(TinyMLP(dropout=0.1), data)
    strategy = DiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=0.01), H=3)
    trainer.fit(strategy, 2, max_steps=MAX_STEPS, batch_size=BATCH, shuffle=False, progress=False, run_name="r",
                checkpoint_interval=CHECKPOINT_INTERVAL, **kwargs)
    return trainer


if __name__ == "__main__":
    torch.set_num_threads(1)
    fit(sys.argv[1], int(sys.argv[2]))
