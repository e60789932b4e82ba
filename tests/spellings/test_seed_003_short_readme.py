"""The short README (../shared/seeds/003_*): DiLoCoStrategy(inner_optim='adam', H=100) and
fit(strategy=..., num_nodes=4, device='mps')."""

import pytest
import torch

import toy
from exogym import LocalTrainer
from exogym.strategy import DiLoCoStrategy


def test_example_usage_runs_on_the_best_device_here():
    strategy = DiLoCoStrategy(inner_optim="adam", H=100)
    assert strategy.optim_spec.cls is torch.optim.Adam and strategy.H == 100
    trainer = LocalTrainer(toy.TinyMLP(), toy.make_classification(128), toy.make_classification(32, seed=1))
    trainer.fit(strategy=strategy, num_nodes=4, device="cpu", max_steps=3, batch_size=8, progress=False, logger=False)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS: the snippet runs as written")
def test_device_mps_where_there_is_none_says_what_to_use():
    trainer = LocalTrainer(toy.TinyMLP(), toy.make_classification(128))
    with pytest.raises(ValueError, match="needs Apple MPS, which is not available here; use device='cpu'"):
        trainer.fit(strategy=DiLoCoStrategy(inner_optim="adam", H=100), num_nodes=4, device="mps", logger=False)
