"""diloco_sim.DilocoSimulator: the earlier simulator's arguments on exogym's engine."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import toy
from diloco_sim import DilocoSimulator, EvalStats, TrainStats
from exogym import Trainer
from exogym.strategy import DiLoCoStrategy, OptimSpec


class Net(torch.nn.Module):
    def __init__(self, hidden=16):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))

    def forward(self, x):
        return self.net(x)


class WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def _sim(**kwargs):
    args = dict(model_cls=Net, model_kwargs={"hidden": 16}, optimizer_kwargs={"lr": 1e-2},
                train_dataset=toy.make_classification(256), eval_dataset=toy.make_classification(64, seed=1),
                loss_fn=F.cross_entropy, num_nodes=2, diloco_interval=4, batch_size=8, max_local_step=12,
                eval_interval=6, eval_iters=2, seed=3, progress=False)
    args.update(kwargs)
    return DilocoSimulator(**args)


def test_same_parameters_as_the_equivalent_trainer_fit():
    model = _sim().train()
    torch.manual_seed(3)
    wrapped = WithLoss(Net(hidden=16))
    strategy = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-2),
                              outer_optim_spec=OptimSpec(torch.optim.SGD, lr=0.7, nesterov=True, momentum=0.9), H=4)
    ref = Trainer(wrapped, toy.make_classification(256)).fit(strategy, 2, max_steps=12, batch_size=8, seed=3,
                                                            progress=False, logger=False)
    assert isinstance(model, Net)
    assert_close(list(model.parameters()), list(ref.model.parameters()), rtol=0, atol=0)


def test_hooks_get_every_step_and_every_evaluation(tmp_path):
    train, evals = [], []
    _sim(train_loss_hook=train.append, eval_loss_hook=evals.append, ckpt_interval=2, save_dir=tmp_path).train()
    assert [s.step for s in train] == list(range(1, 13)) and all(isinstance(s, TrainStats) for s in train)
    assert all(math.isclose(s.perplexity, math.exp(s.loss)) for s in train)
    assert [s.step for s in evals] == [0, 6, 12] and all(isinstance(s, EvalStats) for s in evals)
    assert all(0 <= s.accuracy <= 1 and math.isclose(s.perplexity, math.exp(s.loss)) for s in evals)
    # ckpt_interval counts outer steps: every 2 x 4 local steps, plus the end.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000008", "step_000000012"]


def test_sparta_option_and_wrong_arguments():
    assert _sim(p_sparta=0.1, max_local_step=4)._strategy().__class__.__name__ == "SPARTADiLoCoStrategy"
    with pytest.raises(TypeError, match="model_cls must be a torch.nn.Module subclass"):
        _sim(model_cls=Net())
    with pytest.raises(ValueError, match="diloco_interval must be >= 1, got 0"):
        _sim(diloco_interval=0)
    with pytest.raises(TypeError, match="needs train_dataset and loss_fn"):
        _sim(loss_fn=None)
    with pytest.raises(ValueError, match="ckpt_interval needs save_dir"):
        _sim(ckpt_interval=1)
    with pytest.raises(TypeError, match="optimizer_cls must be a torch.optim.Optimizer subclass"):
        _sim(optimizer_cls=dict)
    with pytest.raises(TypeError, match=r"OptimSpec\(AdamW\) got unexpected keyword argument\(s\) 'learning_rate'"):
        _sim(optimizer_kwargs={"learning_rate": 1e-3})
