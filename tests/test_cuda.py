"""CUDA paths (skipped without a GPU): the same numbers as on CPU, per-node CUDA random streams."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import OptimSpec, SimpleReduceStrategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FIT = dict(progress=False, val_interval=4)


def _fit(device, dropout=0.0, seed=0, devices=None):
    t = Trainer(toy.TinyMLP(dropout=dropout), toy.make_classification(128), toy.make_classification(32, seed=1))
    kwargs = dict(devices=devices) if devices else dict(device=device)
    model = t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1)), 4, batch_size=8, max_steps=8,
                  seed=seed, **kwargs, **FIT)
    return [p.detach().cpu() for p in model.parameters()], t.record


def test_cuda_matches_cpu_to_float_rounding():
    cpu, _ = _fit("cpu")
    gpu, record = _fit("cuda")
    assert_close(gpu, cpu, rtol=1e-4, atol=1e-5)
    assert record.config["devices"][0].startswith("cuda")


def _local_models(tag):
    data = toy.make_classification(64)
    t = Trainer(toy.TinyMLP(dropout=0.5), lambda rank, num_nodes, is_val: data)
    t.fit(toy.LocalOnly(tag=tag), 3, batch_size=16, max_steps=6, shuffle=False, device="cuda", progress=False)
    return [[p.detach().cpu() for p in toy.REGISTRY[(tag, r)].parameters()] for r in range(3)]


def test_cuda_dropout_is_per_node_and_reproducible():
    first, again = _local_models("cuda-a"), _local_models("cuda-b")
    for r in range(3):
        assert all(torch.equal(x, y) for x, y in zip(first[r], again[r]))
    assert not all(torch.equal(x, y) for x, y in zip(first[0], first[1]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nodes_spread_round_robin_over_devices():
    params, record = _fit(None, devices=[0, 1])
    assert record.config["devices"] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    cpu, _ = _fit("cpu")
    assert_close(params, cpu, rtol=1e-4, atol=1e-5)


def test_a_dataset_kept_on_the_gpu_trains_as_one_on_the_cpu():
    # the batch gather moves its CPU index to the dataset's device (index_select needs both on one device)
    data = toy.make_classification(128)
    on_gpu = torch.utils.data.TensorDataset(*(t.cuda() for t in data.tensors))
    models = []
    for train in (data, on_gpu):
        t = Trainer(toy.TinyMLP(), train)
        model = t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1)), 2, batch_size=8, max_steps=4,
                      device="cuda", progress=False)
        models.append([p.detach().cpu() for p in model.parameters()])
    assert_close(models[1], models[0], rtol=0, atol=0)
