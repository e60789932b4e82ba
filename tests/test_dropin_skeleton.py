"""The strategy skeletons of the original EXO Gym's llms.txt, making the calls they make on the Strategy base:
`super()._init_node(...)`, building `self.optim` there, `self._setup_scheduler()`, and `super().step()` for the LR
schedule and the step count; and a CommunicationModule composed into a CommunicateOptimizeStrategy."""

import pytest
import torch

import toy
from exogym.strategy.communicate import all_reduce
from exogym.strategy.communicate_optimize_strategy import CommunicateOptimizeStrategy, CommunicationModule
from exogym.strategy.optim import OptimSpec, ensure_optim_spec
from exogym.strategy.strategy import SimpleReduceStrategy, Strategy
from exogym.trainer import Trainer

SCHEDULE = dict(lr_scheduler="lambda_cosine", lr_scheduler_kwargs={"warmup_steps": 3, "cosine_anneal": True})


class GradientMean(Strategy):
    """The lightweight skeleton: its own optimizer in _init_node, then _setup_scheduler(); a step that sums the
    gradients, divides by the nodes, clips, steps and hands the schedule and step count to super().step()."""

    def __init__(self, optim_spec=None, max_norm=None, setups=1, **kwargs):
        super().__init__(**kwargs)
        self.optim_spec = ensure_optim_spec(optim_spec, OptimSpec(torch.optim.AdamW))
        self.max_norm, self.setups = max_norm, setups

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = self.optim_spec.build(model)
        for _ in range(self.setups):
            self._setup_scheduler()

    def step(self):
        for p in self.model.parameters():
            if p.grad is not None:
                all_reduce(p.grad)
                p.grad.div_(self.num_nodes)
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.optim.step()
        super().step()


def _fit(strategy, nodes=3, steps=8):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
    model = trainer.fit(strategy=strategy, num_nodes=nodes, max_steps=steps, batch_size=8, val_interval=4,
                        progress=False, logger=False)
    return model, trainer.record


def test_the_lightweight_skeleton_trains_exactly_as_ddp_with_its_schedule():
    # Two nodes: the sum of two gradients halved is the mean to the bit, however the mean is computed.
    spec = OptimSpec(torch.optim.AdamW, lr=1e-2)
    model, record = _fit(GradientMean(optim_spec=spec, max_norm=1.0, **SCHEDULE), nodes=2)
    ddp_model, ddp = _fit(SimpleReduceStrategy(optim_spec=spec, max_norm=1.0, **SCHEDULE), nodes=2)
    assert record.column("lr") == ddp.column("lr")  # warm-up over 3 steps, then the cosine: the schedule ran
    assert record.column("lr")[:3] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ddp_model.parameters()))
    assert record.bytes_per_node == ddp.bytes_per_node


def test_setup_scheduler_builds_the_schedule_once_and_is_harmless_without_one():
    twice, _ = _fit(GradientMean(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1), setups=2, **SCHEDULE), steps=4)
    once, _ = _fit(GradientMean(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1), **SCHEDULE), steps=4)
    assert all(torch.equal(a, b) for a, b in zip(twice.parameters(), once.parameters()))
    _, record = _fit(GradientMean(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1)), steps=4)  # no lr_scheduler
    assert record.column("lr") == [0.1] * 4
    assert Strategy._setup_scheduler.__doc__ and "build_scheduler" in Strategy._setup_scheduler.__doc__


def test_setup_scheduler_before_an_optimizer_says_what_to_build_first():
    class TooEarly(Strategy):
        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            self._setup_scheduler()
            self.optim = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(self):
            self.optim.step()
            super().step()

    with pytest.raises(TypeError, match=r"TooEarly has an lr_scheduler but no self.optim yet; build self.optim"):
        _fit(TooEarly(**SCHEDULE), steps=2)


class EveryOther(CommunicationModule):
    """The composable skeleton's module: average the parameters every 2 steps, over the nodes."""

    def _init_node(self, model, rank, num_nodes):
        pass

    def communicate(self, model, rank, num_nodes, local_step):
        if num_nodes > 1 and local_step % 2 == 0 and local_step > 0:
            for p in model.parameters():
                all_reduce(p.data)
                p.data.div_(num_nodes)


class Composed(CommunicateOptimizeStrategy):
    def __init__(self, optim_spec=None, **kwargs):
        super().__init__(communication_modules=[EveryOther()],
                         optim_spec=ensure_optim_spec(optim_spec, OptimSpec(torch.optim.AdamW)), **kwargs)


def test_the_composable_skeleton_averages_on_its_schedule():
    from exogym.strategy import FedAvgStrategy

    spec = OptimSpec(torch.optim.SGD, lr=0.1)
    model, record = _fit(Composed(optim_spec=spec, **SCHEDULE), nodes=2)
    fedavg, reference = _fit(FedAvgStrategy(spec, H=2, **SCHEDULE), nodes=2)
    assert record.column("lr") == reference.column("lr")
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.parameters(), fedavg.parameters()))
    assert record.bytes_per_node[0] > 0
