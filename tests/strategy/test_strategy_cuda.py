"""The strategies on a GPU (skipped without one): the same numbers as on the CPU, to float rounding."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import DeMoStrategy, DGCStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec, SPARTAStrategy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FIT = dict(progress=False, logger=False, val_interval=100)
SGD = OptimSpec(torch.optim.SGD, lr=0.1)


def fit(strategy, device):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256))
    model = trainer.fit(strategy, 4, batch_size=8, max_steps=12, device=device, **FIT)
    return [p.detach().cpu() for p in model.parameters()], trainer.record


@pytest.mark.parametrize("make", [
    lambda: DiLoCoStrategy(SGD, H=3),  # the global model stays on the CPU, the nodes' on the GPU
    lambda: FedAvgStrategy(SGD, H=2, island_size=2, client_sampling=0.5),
    lambda: SPARTAStrategy(SGD, p_sparta=0.3, async_delay=1),
], ids=["diloco", "fedavg", "sparta"])
def test_gpu_matches_cpu(make):
    cpu, cpu_record = fit(make(), "cpu")
    gpu, gpu_record = fit(make(), "cuda")
    assert_close(gpu, cpu, rtol=1e-4, atol=1e-5)
    assert gpu_record.bytes_per_node == cpu_record.bytes_per_node


def test_demo_runs_on_the_gpu():
    _, record = fit(DeMoStrategy(lr=1e-2, compression_topk=4, compression_chunk=4), "cuda")
    losses = record.column("loss")
    assert sum(losses[-3:]) < sum(losses[:3])


def test_dgc_runs_on_the_gpu():
    make = lambda: DGCStrategy(SGD, target_sparsity=0.05, warmup_steps=4, clip_threshold=1.0)  # noqa: E731
    _, record = fit(make(), "cuda")
    losses = record.column("loss")
    assert sum(losses[-3:]) < sum(losses[:3])
    assert record.bytes_per_node == fit(make(), "cpu")[1].bytes_per_node  # k depends on the sizes only
