"""A model of many tensors over processes=P (issue 46, item 1): each process is handed its part of the plan (the
model, its nodes' data and checkpointed states) in a way that does not grow with the number of tensors, so a model
of 1,000 tensors starts and resumes over two processes as over one. (multiprocessing's forkserver passes at most
about 250 file descriptors to a process it starts, and torch sends each tensor as one when pickled for a process.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exogym import Trainer
from exogym.strategy import DiLoCoStrategy
from exogym.strategy.optim import OptimSpec
from toy import make_classification

TENSORS = 1000


class ManyTensors(torch.nn.Module):
    """A linear classifier whose logits get TENSORS - 2 scalar offsets (each its own parameter)."""

    def __init__(self, dim: int = 8, classes: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(dim, classes)
        self.offsets = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(())) for _ in range(TENSORS - 2))

    def forward(self, batch):
        x, y = batch
        logits = self.linear(x) + torch.stack(list(self.offsets)).sum() / len(self.offsets)
        return F.cross_entropy(logits, y)


def _fit(processes: int, **kwargs):
    trainer = Trainer(ManyTensors(), make_classification(64))
    model = trainer.fit(DiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.1), H=2), 2, max_steps=4, batch_size=8,
                        shuffle=False, progress=False, logger=False, processes=processes, **kwargs)
    return trainer, model


@pytest.mark.spawns
def test_a_model_of_1000_tensors_starts_and_resumes_over_two_processes(tmp_path):
    assert len(list(ManyTensors().parameters())) == TENSORS
    one, one_model = _fit(1)
    _, _ = _fit(2, checkpoint_interval=2, checkpoint_dir=tmp_path / "ckpt")
    resumed, resumed_model = _fit(2, resume_from=tmp_path / "ckpt" / "step_000000002")
    assert all(torch.equal(a, b) for a, b in zip(one_model.parameters(), resumed_model.parameters()))
    assert resumed.record.node_loss == one.record.node_loss
