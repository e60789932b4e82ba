"""Equivalences that must hold between strategies (final parameters compared)."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import (CommunicateOptimizeStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec,
                             SimpleReduceStrategy, SPARTADiLoCoStrategy, SPARTAStrategy)
from exogym.strategy.federated_averaging import AveragingCommunicator
from exogym.strategy.diloco import DiLoCoCommunicator
from exogym.strategy.sparta import SparseCommunicator
from strategy_toys import FIT

SGD = OptimSpec(torch.optim.SGD, lr=0.1)
ADAMW = OptimSpec(torch.optim.AdamW, lr=1e-2)
DATA = toy.make_classification(256)


def fit(strategy, nodes=4, steps=12, **kwargs):
    return toy.params(Trainer(toy.TinyMLP(), DATA).fit(strategy, nodes, batch_size=8, max_steps=steps, **FIT, **kwargs))


def plain_sgd_outer(H):
    """DiLoCo whose outer step is theta <- theta - mean(Delta): model averaging every H steps."""
    return dict(H=H, outer_lr=1.0, outer_momentum=0.0)


def test_fedavg_h1_with_sgd_equals_ddp_with_sgd():
    ddp = fit(SimpleReduceStrategy(SGD))
    assert_close(fit(FedAvgStrategy(SGD, H=1)), ddp, rtol=1e-5, atol=1e-6)
    assert_close(fit(FedAvgStrategy(inner_optim="sgd", lr=0.1)), ddp, rtol=1e-5, atol=1e-6)  # the documented spelling


def test_diloco_h1_sgd_inner_and_plain_outer_sgd_equals_ddp():
    assert_close(fit(DiLoCoStrategy(SGD, **plain_sgd_outer(1))), fit(SimpleReduceStrategy(SGD)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_diloco_with_plain_outer_sgd_equals_averaging_every_h(inner):
    diloco = fit(DiLoCoStrategy(inner, **plain_sgd_outer(3)), steps=12)
    fedavg = fit(FedAvgStrategy(inner, H=3), steps=12)
    assert_close(diloco, fedavg, rtol=1e-5, atol=1e-6)
    assert not all(torch.allclose(a, b) for a, b in zip(fedavg, fit(SimpleReduceStrategy(inner))))


@pytest.mark.parametrize("mode", ["random", "sequential", "shuffled_sequential", "partitioned"])
def test_sparta_with_p1_equals_averaging_every_step(mode):
    sparta = fit(SPARTAStrategy(ADAMW, p_sparta=1.0, sparsification_mode=mode))
    assert all(torch.equal(a, b) for a, b in zip(sparta, fit(FedAvgStrategy(ADAMW, H=1))))


def test_sparta_diloco_with_p1_and_plain_outer_equals_averaging_every_step():
    both = fit(SPARTADiLoCoStrategy(ADAMW, p_sparta=1.0, **plain_sgd_outer(4)))
    assert_close(both, fit(FedAvgStrategy(ADAMW, H=1)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [
    lambda: FedAvgStrategy(ADAMW, H=3),
    lambda: FedAvgStrategy(ADAMW, H=2, island_size=1),
    lambda: SPARTAStrategy(ADAMW, p_sparta=0.5),
    lambda: DiLoCoStrategy(ADAMW, **plain_sgd_outer(3)),
    lambda: SPARTADiLoCoStrategy(ADAMW, p_sparta=0.5, **plain_sgd_outer(3)),
], ids=["fedavg", "fedavg-islands", "sparta", "diloco", "sparta-diloco"])
def test_one_node_with_an_averaging_strategy_equals_plain_training(strategy):
    assert_close(fit(strategy(), nodes=1), fit(SimpleReduceStrategy(ADAMW), nodes=1), rtol=1e-5, atol=1e-6)


def test_strategies_are_their_composed_modules():
    fedavg = fit(FedAvgStrategy(SGD, H=2))
    composed = fit(CommunicateOptimizeStrategy([AveragingCommunicator(H=2)], SGD))
    assert all(torch.equal(a, b) for a, b in zip(fedavg, composed))
    hybrid = fit(SPARTADiLoCoStrategy(ADAMW, p_sparta=0.1, H=4, seed=3))
    modules = [SparseCommunicator(0.1, seed=3), DiLoCoCommunicator(4, seed=3)]
    assert all(torch.equal(a, b) for a, b in zip(hybrid, fit(CommunicateOptimizeStrategy(modules, ADAMW))))
