"""Every wrong argument is a clear error before any node starts; the boundary value is accepted."""

import math

import pytest
import torch

import toy
from exogym import Trainer
from exogym.strategy import OptimSpec, SimpleReduceStrategy, Strategy

FIT = dict(progress=False, device="cpu")


def trainer(n=64, model=None):
    return Trainer(model or toy.TinyMLP(), toy.make_classification(n), toy.make_classification(16, seed=1))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_nodes=0), ValueError, "num_nodes must be >= 1, got 0"),
    (dict(num_nodes=2.0), TypeError, "num_nodes must be an int"),
    (dict(batch_size=0), ValueError, "batch_size must be >= 1, got 0"),
    (dict(minibatch_size=3), ValueError, "minibatch_size must divide batch_size=8, got 3"),
    (dict(minibatch_size=16), ValueError, "minibatch_size must divide batch_size=8, got 16"),
    (dict(max_steps=0), ValueError, "max_steps must be >= 1"),
    (dict(val_interval=0), ValueError, "val_interval must be >= 1"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(backend="mpi"), ValueError, "unknown backend 'mpi'"),
    (dict(device="cuda:0"), ValueError, "needs CUDA"),
    (dict(device="tpu"), ValueError, "invalid device 'tpu'"),
    (dict(devices=[]), TypeError, "non-empty list"),
    (dict(bach_size=4), TypeError, "'bach_size' (did you mean 'batch_size'?)"),
    (dict(num_nodes=5), ValueError, "64 examples, fewer than one step needs (num_nodes=5 x batch_size=16 = 80)"),
    (dict(peer_timeout=4.5), ValueError, "peer_timeout must be at least 5 s (five heartbeats of 1 s"),
    (dict(peer_timeout=0), ValueError, "peer_timeout must be at least 5 s"),
    (dict(peer_timeout=math.inf), ValueError, "peer_timeout must be a finite number"),
    (dict(peer_timeout="30"), TypeError, "peer_timeout must be a number"),
    (dict(node_speeds=[1.0, math.inf]), ValueError, "node_speeds[1] must be a finite number, got inf"),
    (dict(node_speeds=[1e-300, 1.0]), ValueError, "node_speeds[0] must be between 1e-06 and 1e+06"),
    (dict(node_speeds=[1.0, 1e300]), ValueError, "node_speeds[1] must be between 1e-06 and 1e+06"),
    (dict(device_flops=math.inf), ValueError, "device_flops[0] must be a finite number"),
])
def test_fit_rejects_bad_arguments(kwargs, error, message):
    if kwargs.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = dict(num_nodes=2, batch_size=8, max_steps=1, progress=False)
    if "devices" not in kwargs:
        args["device"] = "cpu"
    if "num_nodes" in kwargs and kwargs["num_nodes"] == 5:
        args["batch_size"] = 16
    args.update(kwargs)
    num_nodes = args.pop("num_nodes")
    with pytest.raises(error) as info:
        trainer().fit(SimpleReduceStrategy(), num_nodes, **args)
    assert message in str(info.value)


def test_boundary_values_are_accepted():
    # 64 examples on 4 nodes x batch 16: exactly one step per epoch.
    t = trainer(64)
    t.fit(SimpleReduceStrategy(), 4, batch_size=16, minibatch_size=16, val_size=1000, **FIT)
    assert t.record.config["max_steps"] == 1 and t.record.config["val_size"] == 16  # clipped to the val set
    t.fit(SimpleReduceStrategy(), 1, batch_size=1, max_steps=1, minibatch_size=1, val_interval=1, **FIT)
    t.fit(SimpleReduceStrategy(), 1, batch_size=1, max_steps=1, peer_timeout=5, **FIT)
    t.fit(SimpleReduceStrategy(), 1, batch_size=1, max_steps=1, peer_timeout=None, **FIT)
    t.fit(SimpleReduceStrategy(), 2, batch_size=1, max_steps=1, node_speeds=[1e-6, 1e6], **FIT)


@pytest.mark.parametrize("make", ["AsyncDiLoCoStrategy", "DecoupledDiLoCoStrategy", "DiLoCoStrategy"])
def test_an_infinite_outer_lr_is_refused(make):
    import exogym.strategy as strategies
    with pytest.raises(ValueError, match="outer_lr must be a finite number, got inf"):
        getattr(strategies, make)(outer_lr=math.inf)
    getattr(strategies, make)(outer_lr=1e3)


def test_strategy_and_optimizer_keywords_are_strict():
    with pytest.raises(TypeError, match=r"'max_nrom' \(did you mean 'max_norm'\?\).*accepted keywords are:"):
        SimpleReduceStrategy(max_nrom=1.0)
    with pytest.raises(TypeError, match=r"OptimSpec\(AdamW\) got unexpected keyword argument\(s\) 'learning_rate'"):
        OptimSpec(torch.optim.AdamW, learning_rate=1e-3)
    with pytest.raises(ValueError, match="unknown optimizer name 'adamx'.*'adamw'"):
        OptimSpec.from_string("adamx", lr=1e-3)
    with pytest.raises(ValueError, match="unknown optimizer name"):
        SimpleReduceStrategy("adamx")
    # lr next to a full OptimSpec overrides its lr (the original documents pass optim_spec with inner_lr).
    assert SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1), lr=0.2).optim_spec.kwargs == {"lr": 0.2}
    with pytest.raises(ValueError, match="max_norm must be > 0, got 0"):
        SimpleReduceStrategy(max_norm=0)
    with pytest.raises(ValueError, match="unknown lr_scheduler 'cosin'"):
        SimpleReduceStrategy(lr_scheduler="cosin")
    with pytest.raises(TypeError, match="strategy must be an exogym Strategy"):
        trainer().fit("ddp", 2, **FIT)
    # Accepted spellings.
    assert SimpleReduceStrategy("sgd", lr=0.5).optim_spec == OptimSpec(torch.optim.SGD, lr=0.5)
    assert SimpleReduceStrategy(torch.optim.Adam).optim_spec.cls is torch.optim.Adam
    assert OptimSpec.from_string("AdamW", lr=3e-4, weight_decay=0.1).kwargs == {"lr": 3e-4, "weight_decay": 0.1}
    s = SimpleReduceStrategy(lr_scheduler="lambda_cosine", lr_scheduler_kwargs={"warmup_steps": 3})
    assert s.lr_schedule.warmup_steps == 3 and s.lr_schedule.kind == "lambda_cosine"
    with pytest.raises(TypeError, match=r"lr_scheduler=StepLR got unexpected keyword argument\(s\) 'warmup_steps'"):
        SimpleReduceStrategy(lr_scheduler=torch.optim.lr_scheduler.StepLR, warmup_steps=3)
    with pytest.raises(TypeError, match="given both as an argument and in lr_scheduler_kwargs"):
        SimpleReduceStrategy(warmup_steps=3, lr_scheduler_kwargs={"warmup_steps": 2})
    with pytest.raises(TypeError, match="without an lr_scheduler"):
        SimpleReduceStrategy(lr_scheduler_kwargs={"step_size": 2})


def test_model_contract_errors_name_the_fix():
    class NotScalar(toy.TinyMLP):
        def forward(self, batch):
            return self.net(batch[0])

    class NoLoss(toy.TinyMLP):
        def forward(self, batch):
            return {"acc": torch.tensor(1.0)}

    class Detached(toy.TinyMLP):
        def forward(self, batch):
            return super().forward(batch)["loss"].detach()

    for model, message in ((NotScalar(), r"(?s)tensor of shape \(8, 3\), not a loss \(logits\?\).*class WithLoss"),
                           (NoLoss(), "without a 'loss' entry"), (Detached(), "does not require grad")):
        with pytest.raises(TypeError, match=message):
            trainer(model=model).fit(SimpleReduceStrategy(), 2, batch_size=8, max_steps=1, **FIT)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Trainer(lambda batch: 0, toy.make_classification(8))
    with pytest.raises(TypeError, match="train_dataset must be a Dataset"):
        Trainer(toy.TinyMLP(), 42)


def test_a_nan_loss_stops_the_run_and_names_the_step():
    class Explodes(toy.TinyMLP):
        def forward(self, batch):
            loss = super().forward(batch)["loss"]
            return loss * math.inf if self.training and self.calls() >= 3 else loss

        def calls(self):
            self.n = getattr(self, "n", 0) + 1
            return self.n

    with pytest.raises(FloatingPointError, match="training loss on node 0 is (nan|inf) at step 3"):
        trainer(model=Explodes()).fit(SimpleReduceStrategy(), 1, batch_size=8, max_steps=6, **FIT)


def test_the_users_model_and_random_state_are_untouched():
    model = toy.TinyMLP(dropout=0.2)
    before = toy.params(model)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    out = trainer(model=model).fit(SimpleReduceStrategy(lr=0.1), 2, batch_size=8, max_steps=3, **FIT)
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(a, b) for a, b in zip(before, toy.params(model)))
    assert out is not model and not all(torch.equal(a, b) for a, b in zip(before, toy.params(out)))


class _NoOptim(Strategy):
    def step(self):
        super().step()


def test_custom_strategy_without_an_optimizer_but_with_a_schedule_is_rejected():
    with pytest.raises(TypeError, match="has an lr_scheduler but no self.optim"):
        trainer().fit(_NoOptim(warmup_steps=2), 1, batch_size=8, max_steps=1, **FIT)
