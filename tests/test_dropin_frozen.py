"""Frozen parameters (requires_grad=False) are not communicated by any strategy: a frozen layer costs the bytes, and
gives the trajectory, of the same layer held as buffers, and it comes back bit-equal, for any number of nodes.
A model with nothing to train is refused before any node starts."""

import pytest
import torch
import torch.nn.functional as F

import toy
from exogym import Trainer
from exogym.strategy import (AveragingCommunicator, CommunicateOptimizeStrategy, DeMoStrategy, DGCStrategy,
                             DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy, SPARTADiLoCoStrategy,
                             SPARTAStrategy, StreamingDiLoCoStrategy, Strategy)

SGD = OptimSpec(torch.optim.SGD, lr=0.1)


class ModelAveraging(Strategy):
    """A custom strategy on the base class's helper: a local step, then the parameters averaged."""

    def __init__(self, **kwargs):
        super().__init__(optim_spec=SGD, **kwargs)

    def step(self):
        self.update_parameters()
        self.communicate_models()
        super().step()


STRATEGIES = {
    "ddp": lambda: SimpleReduceStrategy(SGD),
    "diloco": lambda: DiLoCoStrategy(SGD, H=2),
    "diloco_int8": lambda: DiLoCoStrategy(SGD, H=2, quantization_bits=8),
    "sparta": lambda: SPARTAStrategy(SGD, p_sparta=0.3),
    "sparta_topk": lambda: SPARTAStrategy(SGD, p_sparta=0.3, compression_method="topk"),
    "fedavg": lambda: FedAvgStrategy(SGD, H=2),
    "averaging_int8": lambda: CommunicateOptimizeStrategy([AveragingCommunicator(2, quantization_bits=8)], SGD),
    "sparta_diloco": lambda: SPARTADiLoCoStrategy(SGD, H=2, p_sparta=0.3),
    "demo": lambda: DeMoStrategy(lr=0.01, compression_topk=4, compression_chunk=8),
    "dgc": lambda: DGCStrategy(SGD, target_sparsity=0.1),
    "streaming_diloco": lambda: StreamingDiLoCoStrategy(SGD, H=4, num_fragments=2),
    "model_averaging": ModelAveraging,
}


class FrozenInput(toy.TinyMLP):
    """x -> a fixed random linear map -> TinyMLP; the map's weight and bias are frozen parameters."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.front = torch.nn.Linear(8, 8)
        self.front.requires_grad_(False)

    def forward(self, batch):
        x, y = batch
        return super().forward((self.front(x), y))


class BufferInput(toy.TinyMLP):
    """The same map held as buffers: what a frozen parameter must cost and do."""

    def __init__(self):
        super().__init__()
        front = FrozenInput().front
        self.register_buffer("weight", front.weight.detach().clone())
        self.register_buffer("bias", front.bias.detach().clone())

    def forward(self, batch):
        x, y = batch
        return super().forward((F.linear(x, self.weight, self.bias), y))


def _fit(model, strategy, nodes):
    trainer = Trainer(model, toy.make_classification(512), toy.make_classification(32, seed=1))
    out = trainer.fit(strategy, nodes, max_steps=6, batch_size=8, val_interval=3, logger=False, progress=False)
    return out, trainer.record


@pytest.mark.parametrize("nodes", [3, 7])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_frozen_parameter_costs_and_does_what_a_buffer_does(name, nodes):
    frozen = FrozenInput()
    before = [p.detach().clone() for p in frozen.front.parameters()]
    out, record = _fit(frozen, STRATEGIES[name](), nodes)
    reference, buffered = _fit(BufferInput(), STRATEGIES[name](), nodes)
    assert record.bytes_per_node == buffered.bytes_per_node  # not one byte for the frozen layer
    assert all(torch.equal(a, b) for a, b in zip(before, out.front.parameters()))  # bit-equal after the run
    assert all(torch.equal(a, b) for a, b in zip(out.net.parameters(), reference.net.parameters()))
    assert record.node_loss == buffered.node_loss  # the same trajectory on every node
    # (not the same global validation: the buffered model's global model averages K copies of the buffers, which
    # drifts for K = 3 or 7; the frozen parameters are taken from one node)


@pytest.mark.parametrize("nodes", [5, 6])
@pytest.mark.parametrize("name", ["sparta", "fedavg"])  # the two that used to average frozen parameters
def test_frozen_parameters_stay_bit_equal_for_other_node_counts(name, nodes):
    frozen = FrozenInput()
    before = [p.detach().clone() for p in frozen.front.parameters()]
    out, record = _fit(frozen, STRATEGIES[name](), nodes)
    assert all(torch.equal(a, b) for a, b in zip(before, out.front.parameters()))
    assert record.bytes_per_node == _fit(BufferInput(), STRATEGIES[name](), nodes)[1].bytes_per_node


class Untouchable(torch.nn.Module):
    def forward(self, batch):
        raise AssertionError("a node started")


class NoParameters(Untouchable):
    pass


class AllFrozen(Untouchable):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 3).requires_grad_(False)


@pytest.mark.parametrize("strategy", [SimpleReduceStrategy, DiLoCoStrategy, SPARTAStrategy])
def test_a_model_with_nothing_to_train_is_refused_before_any_node_starts(strategy):
    data = toy.make_classification(64)
    with pytest.raises(ValueError, match=r"the model NoParameters has no parameters, so there is nothing to train"):
        Trainer(NoParameters(), data).fit(strategy(), 2, max_steps=2, batch_size=8, progress=False)
    with pytest.raises(ValueError, match=r"the model AllFrozen has no trainable parameters: all 2 of them \(27 "
                                         r"values\) have requires_grad=False; unfreeze"):
        Trainer(AllFrozen(), data).fit(strategy(), 2, max_steps=2, batch_size=8, progress=False)


def test_one_trainable_parameter_is_enough():
    model = AllFrozen()
    model.layer.bias.requires_grad_(True)
    model.forward = lambda batch: F.cross_entropy(model.layer(batch[0]), batch[1])
    Trainer(model, toy.make_classification(64)).fit(SimpleReduceStrategy(SGD), 2, max_steps=1, batch_size=8,
                                                    logger=False, progress=False)
