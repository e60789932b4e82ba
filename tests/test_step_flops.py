"""A step's FLOPs are counted once for the nodes sharing an execution, per model shape and batch signature, and each
node's compute time is what its own count gives."""

import pytest
import torch
from torch.utils.data import TensorDataset

import exogym.engine.execution as execution
from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec

FIT = dict(progress=False, device="cpu", logger=False)


class MeanEmbedding(torch.nn.Module):
    """Token ids -> a loss whose FLOPs grow with the sequence length (the linear layer runs per token)."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 4)

    def forward(self, batch):
        ids, y = batch
        return torch.nn.functional.cross_entropy(self.out(self.emb(ids)).mean(1), y)


def _tokens(rank: int, num_nodes: int, is_val: bool) -> TensorDataset:
    g = torch.Generator().manual_seed(rank)
    length = 4 if rank % 2 == 0 else 12  # even nodes read sequences three times shorter
    return TensorDataset(torch.randint(0, 16, (64, length), generator=g), torch.randint(0, 4, (64,), generator=g))


def test_nodes_count_once_per_batch_shape_and_keep_their_own_compute_times(monkeypatch):
    counted = []
    real = execution.FlopCounterMode

    class Counting(real):
        def __exit__(self, *exc):
            counted.append(self.get_total_flops())
            return super().__exit__(*exc)

    monkeypatch.setattr(execution, "FlopCounterMode", Counting)
    trainer = Trainer(MeanEmbedding(), _tokens)
    trainer.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.1), H=2), 4, max_steps=4, batch_size=8,
                network="ideal", device_flops=1e9, **FIT)
    assert len(counted) == 2 and counted[1] > 2 * counted[0]  # one count per sequence length, not one per node
    compute = [clock["compute_s"] for clock in trainer.record.sim_time_per_node]
    # every node's compute time is its own shape's FLOPs over the device's speed, a step each
    assert compute[0] == compute[2] == pytest.approx(4 * counted[0] / 1e9)
    assert compute[1] == compute[3] == pytest.approx(4 * counted[1] / 1e9)
