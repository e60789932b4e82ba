"""The technical document (../shared/seeds/002_*): LocalTrainer, FedAvg with inner_optim=<an OptimSpec> and H,
fit(num_epochs=..., strategy=..., num_nodes=3, device="cpu"), a dataset or a dataset factory."""

import torch

import toy
from exogym import LocalTrainer, Trainer
from exogym.strategy import FedAvgStrategy, OptimSpec

QUIET = dict(progress=False, logger=False)


def test_usage_example_fedavg_with_an_optim_spec_as_inner_optim():
    assert LocalTrainer is Trainer
    optim_spec = OptimSpec(torch.optim.SGD, lr=0.1)
    trainer = LocalTrainer(toy.TinyMLP(), toy.make_classification(96), toy.make_classification(32, seed=1))
    strategy = FedAvgStrategy(inner_optim=optim_spec, H=5)
    model = trainer.fit(num_epochs=2, strategy=strategy, num_nodes=3, device="cpu", batch_size=8, **QUIET)
    assert strategy.optim_spec == optim_spec and trainer.record.config["max_steps"] == 8  # 2 epochs of 32 / 8
    assert isinstance(model, toy.TinyMLP)


def test_fedavg_averages_models_every_E_steps_and_returns_the_average():
    """After a round (H=4 steps) every node holds the average; at the end (step 8, a round's end) the returned
    model is that average, which differs from what any node had before averaging."""
    optim_spec = OptimSpec(torch.optim.SGD, lr=0.1)
    trainer = LocalTrainer(toy.TinyMLP(), toy.make_classification(96))
    model = trainer.fit(num_epochs=2, strategy=FedAvgStrategy(inner_optim=optim_spec, H=4), num_nodes=3, device="cpu",
                        batch_size=8, **QUIET)
    alone = LocalTrainer(toy.TinyMLP(), toy.make_classification(96)).fit(
        num_epochs=2, strategy=toy.LocalOnly(lr=0.1), num_nodes=3, device="cpu", batch_size=8, **QUIET)
    # LocalOnly's returned model is the plain average of the unsynchronised nodes: FedAvg's rounds change it.
    assert not torch.equal(model.net[0].weight, alone.net[0].weight)
    assert trainer.record.bytes_per_node[0] > 0


def test_direct_dataset_and_factory():
    data = toy.make_classification(96)

    def factory(rank, num_nodes, is_val):
        return torch.utils.data.Subset(data, range(rank, len(data), num_nodes))

    for train in (data, factory):
        LocalTrainer(toy.TinyMLP(), train).fit(num_epochs=1, strategy=FedAvgStrategy(H=5), num_nodes=3, device="cpu",
                                               batch_size=8, **QUIET)
