"""Tutorial 1 (beginner): one model, one dataset, a strategy and num_nodes; what comes back.

    python run/tutorial_basic.py [--steps 200]

A Trainer holds the model and the data. fit(strategy, num_nodes) copies the model to every node, gives each
node its own shard of the data, and trains them together; the strategy decides what the nodes exchange. Here
it is DDP (SimpleReduceStrategy): gradients are averaged every step, so the 4 nodes act as one model trained
on 4x the batch. fit returns the global model (the nodes' average) and leaves the measurements on
trainer.record.
"""

from __future__ import annotations

import argparse

import torch

from _toy import MLP, points
from exogym import Trainer
from exogym.strategy import OptimSpec, SimpleReduceStrategy


def main(steps: int = 200) -> dict:
    torch.manual_seed(0)
    trainer = Trainer(MLP(), points(4096, seed=1), points(512, seed=2))
    strategy = SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=3e-3))
    model = trainer.fit(strategy=strategy, num_nodes=4, max_steps=steps, batch_size=32, val_interval=50,
                        progress=False, logger=False)
    rec = trainer.record
    print(f"trained {len(rec.train)} steps on 4 nodes x 32 examples; the returned model is a {type(model).__name__}")
    print(f"first and last training loss: {rec.train[0]['loss']:.3f} -> {rec.train[-1]['loss']:.3f}")
    print(f"validation of the global model: loss {rec.val[-1]['global_loss']:.3f}, "
          f"accuracy {rec.val[-1]['global_accuracy']:.1%}")
    print(f"each node sent {rec.bytes_per_node[0] / 1e6:.2f} MB (a ring all-reduce of the gradients every step)")
    return {"first_loss": rec.train[0]["loss"], "last_loss": rec.train[-1]["loss"], "bytes": rec.bytes_per_node[0]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
