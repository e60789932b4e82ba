"""Every strategy on a small real task: it learns, its bytes are what its description says, it resumes
exactly; and user-written communication modules compose."""

import pytest
import torch
from torch.testing import assert_close
from torch.utils.data import Subset

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import (CommunicateOptimizeStrategy, CommunicationModule, DeMoStrategy, DGCStrategy,
                             DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy, SPARTADiLoCoStrategy,
                             SPARTAStrategy)
from exogym.comm.collectives import all_reduce
from strategy_toys import FIT, run_linear

K, STEPS, H, P = 4, 40, 5, 0.05
MODEL_BYTES = 4 * (16 * 8 + 16 + 3 * 16 + 3)  # TinyMLP in fp32
DDP_STEP = all_reduce_bytes(MODEL_BYTES, K)  # what DDP sends per node per step
DEMO_STEP = (K - 1) * (8 * 4 + 4 * 4 + 4 * 4 + 1 * 3) * (8 + 4)  # chunks x topk x (index + value), chunk 4, topk 4
DGC_STEP = (K - 1) * (7 + 1 + 3 + 1) * (4 + 4)  # ceil(P x numel) entries per parameter x (int32 index + fp32 value)

STRATEGIES = {
    "ddp": (lambda: SimpleReduceStrategy(lr=1e-2), 1.0),
    "diloco": (lambda: DiLoCoStrategy(lr=1e-2, H=H), 1 / H),
    "fedavg": (lambda: FedAvgStrategy(lr=0.2, H=H), 1 / H),
    "fedavg-islands": (lambda: FedAvgStrategy(lr=0.2, H=H, island_size=2), 1 / H * (2 * 1 / 2) / (2 * 3 / 4)),
    "sparta": (lambda: SPARTAStrategy(lr=1e-2, p_sparta=P), P),
    "sparta-diloco": (lambda: SPARTADiLoCoStrategy(lr=1e-2, p_sparta=P, H=H), P + 1 / H),
    "demo": (lambda: DeMoStrategy(lr=1e-2, compression_topk=4, compression_chunk=4), DEMO_STEP / DDP_STEP),
    "dgc": (lambda: DGCStrategy(lr=0.05, target_sparsity=P, momentum=0.9), DGC_STEP / DDP_STEP),
}


def task():
    data = toy.make_classification(640)
    return Trainer(toy.TinyMLP(), Subset(data, range(512)), Subset(data, range(512, 640)))


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_learns_and_sends_what_its_description_says(name):
    make, fraction_of_ddp = STRATEGIES[name]
    trainer = task()
    trainer.fit(make(), K, batch_size=8, max_steps=STEPS, **dict(FIT, val_interval=STEPS))
    losses = trainer.record.column("loss")
    assert sum(losses[-10:]) < 0.75 * sum(losses[:10])
    val = trainer.record.val
    assert val[-1]["global_loss"] < 0.8 * 1.1  # the global model learned too (chance is ln 3 = 1.1)
    sent = trainer.record.bytes_per_node[0] / STEPS
    tolerance = 0.25 if name.startswith("sparta") else 1e-9  # random selection: p n entries on average
    assert abs(sent / (fraction_of_ddp * DDP_STEP) - 1) <= tolerance, (sent, fraction_of_ddp * DDP_STEP)


@pytest.mark.parametrize("make", [
    lambda: DiLoCoStrategy(lr=1e-2, H=3),
    lambda: FedAvgStrategy(lr=0.2, H=2, island_size=2),
    lambda: SPARTAStrategy(lr=1e-2, p_sparta=0.2, async_delay=2),
    lambda: DeMoStrategy(lr=3e-3, compression_topk=4, compression_chunk=4),
], ids=["diloco", "fedavg-islands", "sparta-async", "demo"])
def test_resume_is_identical_to_not_stopping(make, tmp_path):
    fit = dict(batch_size=8, max_steps=12, **FIT)
    full_t = task()
    full = full_t.fit(make(), K, **fit)
    task().fit(make(), K, checkpoint_interval=7, checkpoint_dir=tmp_path, **fit)
    resumed_t = task()
    resumed = resumed_t.fit(make(), K, resume_from=tmp_path / "step_000000007", **fit)
    assert all(torch.equal(a, b) for a, b in zip(toy.params(full), toy.params(resumed)))
    assert resumed_t.record.bytes_per_node == full_t.record.bytes_per_node


SEEN: list = []


class SumEvery2(CommunicationModule):
    """A fake with a visible effect: every 2 steps the parameters become their sum over the nodes."""

    def _init_node(self, model, rank, num_nodes):
        self.model = model

    def communicate(self, model, rank, num_nodes, local_step):
        if local_step % 2 == 0:
            with torch.no_grad():
                for p in model.parameters():
                    all_reduce(p.data)


class Record(CommunicationModule):
    def communicate(self, model, rank, num_nodes, local_step):
        SEEN.append((rank, local_step, model.w.detach().clone()))


def test_modules_run_after_the_inner_step_in_list_order_with_steps_counted_from_one():
    SEEN.clear()
    grads, init, eta = [[1.0, 2.0], [3.0, -1.0]], [0.5, 0.0], 0.1
    strategy = CommunicateOptimizeStrategy([SumEvery2(), Record()], OptimSpec(torch.optim.SGD, lr=eta))
    run_linear(strategy, grads, init, 2)
    assert [(r, s) for r, s, _ in SEEN] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    c, theta0 = torch.tensor(grads), torch.tensor(init)
    assert_close(SEEN[0][2], theta0 - eta * c[0])  # the inner step already happened
    assert_close(SEEN[1][2], theta0 - eta * c[1])
    summed = sum(theta0 - 2 * eta * c[r] for r in range(2))  # then SumEvery2 ran before Record
    assert_close(SEEN[2][2], summed)
    assert_close(SEEN[3][2], summed)
