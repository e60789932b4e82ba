"""Constructor validation, in pairs: the bad value is rejected with a message, the boundary is accepted."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.strategy import (AveragingCommunicator, CommunicateOptimizeStrategy, DeMoStrategy, DiLoCoStrategy,
                             FedAvgStrategy, OptimSpec, SPARTADiLoCoStrategy, SPARTAStrategy)
from exogym.strategy.demo import DeMo
from exogym.strategy.sparta import SparseCommunicator
from strategy_toys import FIT

PAIRS = [
    # (class, bad kwargs, error, message fragment, boundary kwargs that must be accepted)
    (DiLoCoStrategy, dict(H=0), ValueError, "H must be >= 1, got 0", dict(H=1)),
    (DiLoCoStrategy, dict(H=2.5), TypeError, "H must be an int", dict(H=2)),
    (DiLoCoStrategy, dict(outer_lr=0.0), ValueError, "outer_lr must be > 0", dict(outer_lr=1e-9)),
    (DiLoCoStrategy, dict(outer_momentum=1.0), ValueError, "outer_momentum must be in [0, 1)",
     dict(outer_momentum=0.0)),
    (DiLoCoStrategy, dict(outer_momentum=0.0, nesterov=True), ValueError, "pass nesterov=False",
     dict(outer_momentum=0.0, nesterov=False)),
    (DiLoCoStrategy, dict(drop_prob=1.0), ValueError, "drop_prob must be < 1", dict(drop_prob=0.0)),
    (DiLoCoStrategy, dict(lr=1e-3, inner_lr=1e-3), TypeError, "pass one", dict(inner_lr=1e-3)),
    (DiLoCoStrategy, dict(optim_spec="sgd", inner_optim="adamw"), TypeError, "pass one of them",
     dict(inner_optim="adamw")),
    (DiLoCoStrategy, dict(outer_optim_spec="sgd", outer_optim="sgd"), TypeError, "pass one of them",
     dict(outer_optim="sgd")),
    (DiLoCoStrategy, dict(outer_optim="adam", nesterov=True), TypeError, "configure the default outer SGD",
     dict(outer_optim="adam", outer_lr=0.1)),
    (DiLoCoStrategy, dict(inner_optim="adamx"), ValueError, "unknown optimizer name 'adamx'",
     dict(inner_optim="adamax")),
    (FedAvgStrategy, dict(H=0), ValueError, "H must be >= 1", dict(H=1)),
    (FedAvgStrategy, dict(island_size=0), ValueError, "island_size must be >= 1", dict(island_size=1)),
    (FedAvgStrategy, dict(client_sampling=0.0), ValueError, "client_sampling must be > 0",
     dict(client_sampling=1e-6)),
    (FedAvgStrategy, dict(client_sampling=1.5), ValueError, "client_sampling must be <= 1.0",
     dict(client_sampling=1.0)),
    (FedAvgStrategy, dict(local_epochs=0), ValueError, "local_epochs must be >= 1", dict(local_epochs=1)),
    (FedAvgStrategy, dict(H=2, local_epochs=1), TypeError, "pass one of them", dict(local_epochs=1)),
    (FedAvgStrategy, dict(lr=-1.0), ValueError, "lr must be > 0", dict(lr=1e-9)),
    (SPARTAStrategy, dict(p_sparta=0.0), ValueError, "p_sparta must be > 0", dict(p_sparta=1e-9)),
    (SPARTAStrategy, dict(p_sparta=1.01), ValueError, "p_sparta must be <= 1.0", dict(p_sparta=1.0)),
    (SPARTAStrategy, dict(sparsification_mode="block"), ValueError,
     "['random', 'sequential', 'shuffled_sequential', 'partitioned', 'blockwise']",
     dict(sparsification_mode="partitioned")),
    (SPARTAStrategy, dict(async_delay=-1), ValueError, "async_delay must be >= 0", dict(async_delay=0)),
    (SPARTAStrategy, dict(seed=-1), ValueError, "seed must be >= 0", dict(seed=0)),
    (SPARTADiLoCoStrategy, dict(H=0), ValueError, "H must be >= 1", dict(H=1)),
    (SPARTADiLoCoStrategy, dict(p_sparta=2.0), ValueError, "p_sparta must be <= 1.0", dict(p_sparta=1.0)),
    (DeMoStrategy, dict(compression_decay=1.0), ValueError, "compression_decay must be in [0, 1)",
     dict(compression_decay=0.0)),
    (DeMoStrategy, dict(compression_topk=0), ValueError, "compression_topk must be >= 1", dict(compression_topk=1)),
    (DeMoStrategy, dict(compression_chunk=0), ValueError, "compression_chunk must be >= 1",
     dict(compression_chunk=1)),
    (DeMoStrategy, dict(lr=0.0), ValueError, "lr must be > 0", dict(lr=1e-9)),
    (DeMoStrategy, dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0", dict(weight_decay=0.0)),
    (DeMoStrategy, dict(optim_spec=OptimSpec(torch.optim.SGD, momentum=0.9)), TypeError, "DeMo has no ['momentum']",
     dict(optim_spec=OptimSpec(torch.optim.SGD, lr=1e-3))),
    (DeMoStrategy, dict(optim_spec="adamw"), TypeError, "OptimSpec of exogym.strategy.demo.DeMo",
     dict(optim_spec=OptimSpec(DeMo, lr=1e-3))),
]


@pytest.mark.parametrize("cls, bad, error, message, boundary", PAIRS,
                         ids=[f"{p[0].__name__}-{'-'.join(p[1])}" for p in PAIRS])
def test_bad_value_rejected_and_boundary_accepted(cls, bad, error, message, boundary):
    with pytest.raises(error) as info:
        cls(**bad)
    assert message in str(info.value)
    cls(**boundary)


@pytest.mark.parametrize("cls, typo, meant", [
    (DiLoCoStrategy, "outer_lrr", "outer_lr"), (FedAvgStrategy, "island_sise", "island_size"),
    (SPARTAStrategy, "p_spart", "p_sparta"), (SPARTADiLoCoStrategy, "HH", "H"),
    (DeMoStrategy, "compression_topK", "compression_topk"),
])
def test_unknown_keyword_is_rejected_naming_the_accepted_ones(cls, typo, meant):
    with pytest.raises(TypeError) as info:
        cls(**{typo: 1})
    message = str(info.value)
    assert f"unexpected keyword argument(s) '{typo}' (did you mean '{meant}'?)" in message
    assert "accepted keywords are: " in message and "max_norm" in message
    assert "communication_modules" not in message  # only keywords this class really takes


def test_communicate_optimize_strategy_arguments():
    with pytest.raises(TypeError, match="list of CommunicationModule"):
        CommunicateOptimizeStrategy(SparseCommunicator())
    with pytest.raises(TypeError, match="list of CommunicationModule"):
        CommunicateOptimizeStrategy(["sparta"])
    with pytest.raises(ValueError, match="must be the only communication module"):
        CommunicateOptimizeStrategy([AveragingCommunicator(client_sampling=0.5), SparseCommunicator()])
    with pytest.raises(TypeError, match="unexpected keyword argument.*'H'"):
        CommunicateOptimizeStrategy([SparseCommunicator()], H=3)
    CommunicateOptimizeStrategy([AveragingCommunicator(client_sampling=0.5)])
    CommunicateOptimizeStrategy([])


def test_island_size_must_divide_the_nodes_of_a_round():
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(64))
    with pytest.raises(ValueError, match=r"island_size must divide the 8 nodes .* got 3; use one of \[1, 2, 4, 8\]"):
        trainer.fit(FedAvgStrategy(island_size=3), 8, batch_size=4, max_steps=1, **FIT)
    with pytest.raises(ValueError, match=r"the 4 nodes .*client_sampling=0.5\), got 3; use one of \[1, 2, 4\]"):
        trainer.fit(FedAvgStrategy(island_size=3, client_sampling=0.5), 8, batch_size=4, max_steps=1, **FIT)
    trainer.fit(FedAvgStrategy(island_size=8), 8, batch_size=4, max_steps=1, **FIT)


def test_documented_spellings_build_the_documented_optimizers():
    s = FedAvgStrategy(inner_optim="sgd", island_size=4, H=5, lr=0.01)
    assert (s.optim_spec, s.H) == (OptimSpec(torch.optim.SGD, lr=0.01), 5)
    assert SPARTAStrategy(inner_optim="adamw", lr=3e-4, weight_decay=0.1).optim_spec == \
        OptimSpec(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    assert DeMoStrategy(lr=3e-4).optim_spec == OptimSpec(DeMo, lr=3e-4)
    assert DiLoCoStrategy(H=10).config()["H"] == 10
