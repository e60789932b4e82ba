"""What a run records, the LR schedule, the global model, and the documented custom-strategy API."""

import math

import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.data import Dataset

import toy
from exogym import LocalTrainer, Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import OptimSpec, SimpleReduceStrategy, Strategy
from exogym.comm.collectives import all_reduce
from exogym.strategy.lr_schedule import lambda_cosine

FIT = dict(progress=False, device="cpu", logger=False)


def test_record_rows_bytes_and_validation_schedule():
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(40, seed=1))
    t.fit(SimpleReduceStrategy(lr=0.05), 4, batch_size=8, max_steps=7, val_interval=3, val_size=20, **FIT)
    r = t.record
    assert [row["step"] for row in r.train] == list(range(1, 8))
    assert r.column("examples") == [s * 32 for s in range(1, 8)]
    grad_bytes = sum(p.numel() * 4 for p in toy.TinyMLP().parameters())
    per_step = all_reduce_bytes(grad_bytes, 4)  # what each node sends every step
    assert r.column("bytes") == [s * per_step for s in range(1, 8)]  # per node, cumulative
    assert r.bytes_per_node == [7 * per_step] * 4
    assert r.total_bytes == 7 * per_step * 4
    assert [row["step"] for row in r.val] == [0, 3, 6, 7]  # the initial model, every val_interval, the end
    assert set(r.val[0]) == {"step", "local_loss", "global_loss", "local_accuracy", "global_accuracy"}
    # DDP keeps the nodes identical, so node 0's model is the global model (up to averaging's rounding).
    assert math.isclose(r.val[-1]["local_loss"], r.val[-1]["global_loss"], rel_tol=1e-5)
    assert all(0.0 <= a <= 1.0 for a in r.column("accuracy"))
    # The training loss is the mean over nodes.
    assert_close(r.column("loss"), [sum(node[s] for node in r.node_loss) / 4 for s in range(7)])


def test_validation_batches_are_the_same_every_time():
    t = Trainer(toy.TinyMLP(), toy.make_classification(64), toy.make_classification(40, seed=1))
    t.fit(toy.LocalOnly(lr=0.0, tag="frozen"), 2, batch_size=8, max_steps=4, val_interval=1, val_size=24, **FIT)
    losses = t.record.column("global_loss", table="val")
    assert len(losses) == 5 and len(set(losses)) == 1  # steps 0..4  # lr 0: the same model on the same batches


def test_lambda_cosine_schedule_is_recorded():
    f = lambda_cosine(warmup_steps=4, max_steps=12, cosine_anneal=True, min_lr_factor=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert math.isclose(f(8), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(f(12), 0.1) and math.isclose(f(100), 0.1)
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.2), warmup_steps=4, cosine_anneal=True), 2,
          batch_size=8, max_steps=12, **FIT)
    assert_close(t.record.column("lr"), [0.2 * f(s) for s in range(12)])
    t.fit(SimpleReduceStrategy(lr=0.1, lr_scheduler=torch.optim.lr_scheduler.StepLR,
                               lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5}), 1, batch_size=8, max_steps=5, **FIT)
    assert_close(t.record.column("lr"), [0.1, 0.1, 0.05, 0.05, 0.025])


class BNNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.bn = torch.nn.Linear(8, 3), torch.nn.BatchNorm1d(3)

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.bn(self.lin(x)), y)


def test_global_model_averages_floats_and_takes_integer_buffers_from_node_0():
    data = [toy.make_classification(32, seed=s) for s in range(2)]
    t = Trainer(BNNet(), lambda rank, k, is_val: data[rank])
    model = t.fit(toy.LocalOnly(tag="bn"), 2, batch_size=8, max_steps=3, **FIT)
    nodes = [toy.REGISTRY[("bn", r)].state_dict() for r in range(2)]
    for k, v in model.state_dict().items():
        if v.is_floating_point():
            assert_close(v, (nodes[0][k] + nodes[1][k]) / 2, rtol=0, atol=0)
        else:
            assert torch.equal(v, nodes[0][k])
    assert model.bn.num_batches_tracked.item() == 3


class DictData(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return {"x": x, "y": y}


class DictModel(toy.TinyMLP):
    def forward(self, batch):
        return super().forward((batch["x"], batch["y"]))


def test_dict_batches_and_local_trainer_alias():
    assert LocalTrainer is Trainer
    t = LocalTrainer(DictModel(), DictData(toy.make_classification(64)))
    t.fit(SimpleReduceStrategy(), 2, batch_size=8, minibatch_size=4, max_steps=2, **FIT)
    assert len(t.record.train) == 2


# The custom strategy exactly as the original project's README writes it.
class MyCustomStrategy(Strategy):
    def __init__(self, optim_spec, **kwargs):
        super().__init__(**kwargs)
        self.optim_spec = optim_spec

    def step(self):
        for param in self.model.parameters():
            if param.grad is not None:
                all_reduce(param.grad)
                param.grad.div_(self.num_nodes)
        count = torch.tensor([1], dtype=torch.int32)
        all_reduce(count)  # any dtype
        assert count.item() == self.num_nodes
        self.optim.step()
        super().step()


def test_readme_custom_strategy_runs_unchanged_and_equals_ddp():
    data = toy.make_classification(128)
    spec = OptimSpec(torch.optim.SGD, lr=0.1)
    custom = Trainer(toy.TinyMLP(), data).fit(MyCustomStrategy(spec, warmup_steps=2), 4, batch_size=8,
                                              max_steps=5, **FIT)
    ddp = Trainer(toy.TinyMLP(), data).fit(SimpleReduceStrategy(spec, warmup_steps=2), 4, batch_size=8,
                                           max_steps=5, **FIT)
    assert_close(toy.params(custom), toy.params(ddp), rtol=0, atol=0)


def test_divergence_diagnostics_match_a_direct_computation():
    data = [toy.make_classification(32, seed=s) for s in range(3)]
    t = Trainer(toy.TinyMLP(), lambda rank, k, is_val: data[rank])
    t.fit(toy.LocalOnly(tag="div"), 3, batch_size=8, max_steps=4, diagnostics_interval=2, **FIT)
    assert [row["step"] for row in t.record.diagnostics] == [2, 4]
    flat = torch.stack([torch.cat([p.detach().reshape(-1) for p in toy.REGISTRY[("div", r)].parameters()])
                        for r in range(3)]).double()
    corr = torch.corrcoef(flat)
    expected = (corr[0, 1] + corr[0, 2] + corr[1, 2]).item() / 3
    last = t.record.diagnostics[-1]
    assert math.isclose(last["param_correlation"], expected, rel_tol=1e-9)
    assert math.isclose(last["param_variance"], flat.var(0, unbiased=False).mean().item(), rel_tol=1e-9)
    assert last["param_variance"] > 0 and last["param_correlation"] < 1

    t.fit(SimpleReduceStrategy(lr=0.1), 3, batch_size=8, max_steps=4, diagnostics_interval=4, **FIT)
    assert t.record.diagnostics[0]["param_variance"] == 0.0  # DDP keeps the nodes identical
    assert math.isclose(t.record.diagnostics[0]["param_correlation"], 1.0, rel_tol=1e-12)


class TokenModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)

    def forward(self, batch):
        (ids,) = batch  # [B, T]
        return self.emb(ids).pow(2).mean()


def test_tokens_are_counted_for_batches_of_token_ids():
    ids = torch.randint(0, 11, (64, 5))
    t = Trainer(TokenModel(), torch.utils.data.TensorDataset(ids))
    t.fit(SimpleReduceStrategy(), 2, batch_size=4, max_steps=3, **FIT)
    assert t.record.column("tokens") == [s * 2 * 4 * 5 for s in (1, 2, 3)]
    t2 = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t2.fit(SimpleReduceStrategy(), 1, batch_size=4, max_steps=1, **FIT)
    assert "tokens" not in t2.record.train[0]
    assert t2.record.peak_memory_mb["process_rss"] > 10


def test_autocast_runs_the_forward_pass_in_bfloat16():
    seen = []

    class Probe(toy.TinyMLP):
        def forward(self, batch):
            seen.append(self.net[0](batch[0]).dtype)
            return super().forward(batch)

    t = Trainer(Probe(), toy.make_classification(64))
    t.fit(SimpleReduceStrategy(lr=0.01), 2, batch_size=8, max_steps=2, autocast=True, **FIT)
    assert set(seen) == {torch.bfloat16} and all(math.isfinite(x) for x in t.record.column("loss"))
    seen.clear()
    t.fit(SimpleReduceStrategy(lr=0.01), 2, batch_size=8, max_steps=1, **FIT)
    assert set(seen) == {torch.float32}
