"""The diloco-sim interface (../shared/seeds/004_*): the minimal arguments and every argument of its table;
save_dir without ckpt_interval saves one checkpoint at the end."""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from diloco_sim import DilocoSimulator
from exogym.checkpoint import find_checkpoint


class CNNModel(torch.nn.Module):
    def __init__(self, num_classes=100, width=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.ReLU(), torch.nn.Linear(width, num_classes))

    def forward(self, x):
        return self.net(x)


def _data(n=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x.sum(1) > 0).long())


def test_minimal_arguments():
    simulator = DilocoSimulator(model_cls=CNNModel, model_kwargs={"num_classes": 2}, optimizer_kwargs={"lr": 0.001},
                                train_dataset=_data(), loss_fn=F.cross_entropy, num_nodes=4, diloco_interval=500,
                                batch_size=16, max_local_step=3, progress=False)
    assert isinstance(simulator.train(), CNNModel)


def test_every_argument_of_the_table(tmp_path):
    train_stats, eval_stats = [], []
    simulator = DilocoSimulator(
        model_cls=CNNModel, model_kwargs={"num_classes": 2, "width": 4}, num_nodes=2,
        optimizer_kwargs={"lr": 0.01}, diloco_interval=2, batch_size=8, loss_fn=F.cross_entropy,
        train_dataset=_data(), eval_dataset=_data(32, seed=1), optimizer_cls=torch.optim.SGD, ckpt_interval=1,
        eval_iters=2, save_dir=tmp_path / "ckpt", outer_optimizer_cls=torch.optim.SGD,
        outer_optimizer_kwargs={"lr": 0.7, "nesterov": True, "momentum": 0.9}, max_local_step=4, num_epochs=1,
        cosine_anneal=True, train_loss_hook=train_stats.append, eval_loss_hook=eval_stats.append, eval_interval=2,
        progress=False)
    simulator.train()
    assert len(train_stats) == 4 and eval_stats
    # ckpt_interval counts outer steps: one every diloco_interval=2 local steps
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000000002", "step_000000004"]


def test_save_dir_without_ckpt_interval_saves_once_at_the_end(tmp_path):
    DilocoSimulator(model_cls=CNNModel, model_kwargs={"num_classes": 2}, train_dataset=_data(),
                    loss_fn=F.cross_entropy, num_nodes=2, diloco_interval=2, batch_size=8, max_local_step=5,
                    save_dir=tmp_path / "out", progress=False).train()
    assert [p.name for p in Path(tmp_path / "out").iterdir()] == ["step_000000005"]
    assert find_checkpoint(tmp_path / "out").name == "step_000000005"
