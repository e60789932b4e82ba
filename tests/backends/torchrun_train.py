"""A tiny training script for the torchrun test: `torchrun --standalone --nproc-per-node=2 torchrun_train.py OUT`.

Each process runs one node (backend="torch" under torchrun) and saves what fit returned to OUT.rank<RANK>.pt:
the parameters, every node's loss history and the bytes each node sent, and how many torch process groups are
still alive once fit returned (none may be: one left for the interpreter's exit can abort the process there).
"""

import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared toy models

import toy  # noqa: E402
from exogym import Trainer  # noqa: E402
from exogym.strategy import OptimSpec, SimpleReduceStrategy  # noqa: E402

FIT = dict(batch_size=8, max_steps=6, seed=5, val_interval=3, progress=False, logger=False)


def make_trainer() -> Trainer:
    return Trainer(toy.TinyMLP(dropout=0.1), toy.make_classification(128), toy.make_classification(32, seed=1))


def make_strategy() -> SimpleReduceStrategy:
    return SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = make_trainer()
    model = trainer.fit(make_strategy(), int(os.environ["WORLD_SIZE"]), backend="torch", **FIT)
    gc.collect()  # process groups are not tracked by gc, nor are tuples of untracked objects: look one level in
    refs = [r for o in gc.get_objects() for r in gc.get_referents(o)]
    refs += [x for r in refs if type(r) is tuple for x in r]
    groups = len({id(r) for r in refs if isinstance(r, torch.distributed.ProcessGroup)})
    torch.save({"params": toy.params(model), "node_loss": trainer.record.node_loss,
                "bytes_per_node": trainer.record.bytes_per_node, "groups_alive": groups},
               f"{sys.argv[1]}.rank{os.environ['RANK']}.pt")
