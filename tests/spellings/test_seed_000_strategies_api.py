"""Every spelling of the strategies API reference (../shared/seeds/000_*): common parameters, each strategy's
arguments, OptimSpec, the custom-strategy template, LR schedules, clipping."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.strategy import (DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy,
                             SPARTAStrategy, Strategy)
from exogym.strategy.demo import DeMo
from exogym.strategy.sparta import SparseCommunicator, TopKSparseCommunicator

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8)


def _fit(strategy, nodes=2, steps=4, **kw):
    torch.manual_seed(0)
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128), toy.make_classification(32, seed=1))
    model = trainer.fit(strategy, nodes, max_steps=steps, **FIT, **kw)
    return model, trainer


class Custom(Strategy):
    """The reference's template: communicate_gradients(), then self.optimizer.step()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def step(self):
        self.communicate_gradients()
        self.optimizer.step()
        super().step()

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)


ADAMW = OptimSpec(torch.optim.AdamW, lr=0.001, weight_decay=0.01)


@pytest.mark.parametrize("cls", [SimpleReduceStrategy, DiLoCoStrategy, SPARTAStrategy, FedAvgStrategy, DeMoStrategy,
                                 Custom])
def test_every_strategy_takes_the_common_parameters(cls):
    s = cls(optim_spec=ADAMW, lr_scheduler="constant", lr_scheduler_kwargs={"warmup_steps": 2}, max_norm=1.0)
    assert s.max_norm == 1.0 and s.lr_schedule.kind == "lambda_cosine" and not s.lr_schedule.cosine_anneal
    assert s.optim_spec.kwargs["lr"] == 0.001
    _, t = _fit(s, steps=4)
    assert [row["lr"] for row in t.record.train] == pytest.approx([0.0005, 0.001, 0.001, 0.001])  # warmup, constant


def test_constant_and_cosine_schedules_are_lambda_cosine_in_the_config():
    s = SimpleReduceStrategy(ADAMW, lr_scheduler="cosine", warmup_steps=1)
    assert s.config()["lr_scheduler"] == "lambda_cosine" and s.config()["cosine_anneal"] is True
    _, t = _fit(s, steps=5)
    lrs = [row["lr"] for row in t.record.train]
    assert lrs[0] > lrs[-1] >= 0.1 * 0.001 - 1e-12  # decays to min_lr_factor x lr
    with pytest.raises(ValueError, match="lr_scheduler='constant' means cosine_anneal=False"):
        SimpleReduceStrategy(lr_scheduler="constant", cosine_anneal=True)


def test_diloco_snippet_optim_spec_with_inner_lr_the_lr_wins():
    s = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3), outer_optim="sgd", H=100, inner_lr=1e-4,
                       outer_lr=0.7, nesterov=True)
    assert s.optim_spec == OptimSpec(torch.optim.AdamW, lr=1e-4)
    outer = s.modules[0].outer_optim_spec
    assert outer.cls is torch.optim.SGD and outer.kwargs == {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    assert DiLoCoStrategy(outer_optim="sgd_normalized").modules[0].normalize


@pytest.mark.parametrize("mode, module", [("random", SparseCommunicator), ("topk", TopKSparseCommunicator),
                                          ("blockwise", SparseCommunicator)])
def test_sparta_modes_of_the_reference(mode, module):
    s = SPARTAStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=0.001), p_sparta=0.01, sparsification_mode=mode)
    assert type(s.modules[0]) is module and s.modules[0].p_sparta == 0.01
    _fit(s, steps=2)


def test_fedavg_snippet_local_epochs_islands_and_sampling():
    s = FedAvgStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.01), local_epochs=5, island_size=4,
                       client_sampling=0.1)
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(40 * 8))
    trainer.fit(s, 40, max_steps=2, **FIT)  # 4 clients a round, one island of 4
    t = trainer
    assert t.record.config["strategy_config"]["local_epochs"] == 5


def test_demo_snippet_with_an_adamw_spec_takes_its_lr():
    s = DeMoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=0.001), compression_decay=0.999, compression_topk=32,
                     compression_chunk=64)
    assert s.optim_spec == OptimSpec(DeMo, lr=0.001, compression_decay=0.999, compression_topk=32,
                                     compression_chunk=64)
    _fit(s, steps=2)
    with pytest.raises(TypeError, match=r"DeMo has no \['betas'\]"):
        DeMoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.99)))


def test_optim_spec_both_constructor_spellings():
    full = OptimSpec(torch.optim.AdamW, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)
    named = OptimSpec(optimizer_class=torch.optim.AdamW, lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01, eps=1e-8)
    assert full == named and isinstance(named.build(torch.nn.Linear(2, 2)), torch.optim.AdamW)
    with pytest.raises(TypeError, match="optimizer_class is the original EXO Gym's name for cls"):
        OptimSpec(cls=torch.optim.SGD, optimizer_class=torch.optim.SGD)


def test_hardware_recommendation_snippets():
    assert DiLoCoStrategy(H=50, optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-4)).H == 50
    assert DiLoCoStrategy(H=200, optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-4)).H == 200
    assert SPARTAStrategy(p_sparta=0.01, optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3)).modules[0].p_sparta == 0.01


def test_custom_strategy_template_is_ddp():
    """communicate_gradients() + self.optimizer.step() is DDP: the same model, bit for bit."""
    sgd = OptimSpec(torch.optim.SGD, lr=0.1)
    custom, _ = _fit(Custom(optim_spec=sgd), nodes=3, steps=5)
    ddp, _ = _fit(SimpleReduceStrategy(sgd), nodes=3, steps=5)
    # DDP returns its replica, the custom strategy the average of three equal replicas: equal to rounding
    torch.testing.assert_close(custom.state_dict(), ddp.state_dict(), rtol=1e-6, atol=1e-7)
    alone, _ = _fit(toy.LocalOnly(lr=0.1), nodes=3, steps=5)  # without the exchange the models differ
    assert max((a - b).abs().max() for a, b in zip(custom.state_dict().values(), alone.state_dict().values())) > 1e-3


def test_lr_schedule_and_clipping_snippets():
    s = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-4), lr_scheduler="lambda_cosine",
                       lr_scheduler_kwargs={"warmup_steps": 1000, "cosine_anneal": True, "min_lr_factor": 0.1})
    assert (s.lr_schedule.warmup_steps, s.lr_schedule.cosine_anneal, s.lr_schedule.min_lr_factor) == (1000, True, 0.1)
    assert DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-4), max_norm=1.0).max_norm == 1.0
