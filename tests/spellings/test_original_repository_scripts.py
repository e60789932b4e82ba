"""The original EXO Gym repository's own scripts (exo-explore/gym example/*.py): the same imports, strategy
constructions and fit calls, on a tiny model and local data instead of their downloads."""

import json
import socket
import warnings
from functools import partial

import pytest
import torch
from torch.utils.data import Subset

import toy
from exogym.aux.utils import get_device
from exogym.devices import default_device
from exogym.logger import WandbLogger
from exogym.strategy.communicate import all_reduce, broadcast
from exogym.strategy.optim import OptimSpec
from exogym.strategy.sparta import RandomIndexSelector
from exogym.strategy.strategy import SimpleReduceStrategy, Strategy
from exogym.trainer import Trainer

LR_KWARGS = {"warmup_steps": 2, "cosine_anneal": True}


@pytest.fixture
def wandb_calls(monkeypatch):
    """WandbLogger without W&B: records what fit(wandb_project=...) made of the original's keywords."""
    pytest.importorskip("wandb")
    calls = []
    monkeypatch.setattr(WandbLogger, "start", lambda self, config: calls.append(("start", self.project, self.run_name,
                                                                                self.x_axis)))
    monkeypatch.setattr(WandbLogger, "log", lambda self, table, row: calls.append((table, row["step"])))
    monkeypatch.setattr(WandbLogger, "finish", lambda self, summary: calls.append(("finish", summary["status"])))
    return calls


def image_factory(subset, seed, batch_size, rank, num_nodes, train_dataset):
    """image_train.py's factory shape: bound arguments first, then (rank, num_nodes, train_dataset)."""
    data = toy.make_classification(256 if train_dataset else 64, seed=0 if train_dataset else 1)
    if train_dataset and num_nodes > 1:
        per = len(data) // num_nodes
        data = Subset(data, list(range(rank * per, (rank + 1) * per)))
    return data


def image_strategies(num_nodes):
    """Every branch of image_train.py / nanogpt_train.py's create_strategy, with their keywords."""
    from exogym.strategy.demo import DeMoStrategy
    from exogym.strategy.diloco import DiLoCoStrategy
    from exogym.strategy.federated_averaging import FedAvgStrategy
    from exogym.strategy.sparta import SPARTAStrategy
    from exogym.strategy.sparta_diloco import SPARTADiLoCoStrategy

    common = dict(lr_scheduler="lambda_cosine", lr_scheduler_kwargs=LR_KWARGS, max_norm=1.0)
    optim = OptimSpec(torch.optim.AdamW, lr=1e-3, weight_decay=0.05)
    outer = OptimSpec(torch.optim.SGD, lr=0.7, nesterov=True, momentum=0.9)
    return {
        "ddp": SimpleReduceStrategy(optim_spec=optim, **common),
        "fedavg": FedAvgStrategy(inner_optim_spec=optim, H=2, island_size=num_nodes, **common),
        "sparta": SPARTAStrategy(optim_spec=optim, p_sparta=0.25, async_sparta_delay=1, **common),
        "diloco": DiLoCoStrategy(optim_spec=optim, outer_optim_spec=outer, H=2, **common),
        "demo": DeMoStrategy(optim_spec=optim, compression_decay=0.999, compression_topk=4, compression_chunk=8,
                             weight_decay=0.05, **common),
        "diloco_sparta": SPARTADiLoCoStrategy(inner_optim_spec=optim, outer_optim_spec=outer, H=2, p_sparta=0.25,
                                              sparta_interval=2, **common),
    }


def test_image_train_strategies_map_to_their_canonical_settings():
    s = image_strategies(2)
    assert s["fedavg"].optim_spec == OptimSpec(torch.optim.AdamW, lr=1e-3, weight_decay=0.05)
    assert s["sparta"].modules[0].async_delay == 1
    assert s["diloco_sparta"].modules[0].interval == 2 and s["diloco_sparta"].optim_spec.kwargs["lr"] == 1e-3
    assert s["demo"].optim_spec.kwargs["lr"] == 1e-3 and s["demo"].optim_spec.kwargs["weight_decay"] == 0.05
    assert s["fedavg"].config()["optim_spec"] == s["fedavg"].optim_spec  # config.json: the canonical keyword
    with pytest.raises(TypeError, match="got both async_sparta_delay= and async_delay="):
        from exogym.strategy.sparta import SPARTAStrategy
        SPARTAStrategy(async_sparta_delay=1, async_delay=1)


@pytest.mark.parametrize("name", ["ddp", "fedavg", "sparta", "diloco", "demo", "diloco_sparta"])
def test_image_train_fit_call(name, wandb_calls, tmp_path):
    factory = partial(image_factory, 0.2, 0, 8)
    trainer = Trainer(toy.TinyMLP(), factory, factory)
    trainer.fit(num_epochs=1, max_steps=4, strategy=image_strategies(2)[name], num_nodes=2, device="cpu",
                batch_size=8, minibatch_size=4, shuffle=True, val_size=16, val_interval=2, correlation_interval=2,
                save_dir=str(tmp_path / "checkpoints"), wandb_project="image_exogym", run_name=f"image_{name}",
                progress=False)
    rec = trainer.record
    assert len(rec.diagnostics) == 2 and rec.config["minibatch_size"] == 4  # correlation_interval=2: steps 2, 4
    assert wandb_calls[0] == ("start", "image_exogym", f"image_{name}", "step")
    assert ("train", 4) in wandb_calls and wandb_calls[-1] == ("finish", "completed")
    assert not (tmp_path / "checkpoints").exists()  # save_dir without checkpoint_interval: nothing, as the original
    assert json.loads(open(f"logs/image_{name}/config.json").read())["run_name"] == f"image_{name}"


@pytest.mark.spawns
def test_dataloader_kwargs_load_the_same_batches(tmp_path):
    """num_workers/pin_memory/persistent_workers/prefetch_factor change how batches load, not which: the same
    model comes back."""
    factory = partial(image_factory, 0.2, 0, 8)

    def run(**kw):
        torch.manual_seed(0)
        return Trainer(toy.TinyMLP(), factory, factory).fit(
            1, SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.SGD, lr=0.1)), 2, 4, "cpu", batch_size=8,
            progress=False, logger=False, **kw)
    plain = run()
    loaded = run(dataloader_kwargs={"num_workers": 1, "pin_memory": True, "persistent_workers": True,
                                    "prefetch_factor": 4})
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(TypeError, match=r"dataloader_kwargs\['batch_size'\] cannot be applied: the batch size is "
                                        r"fit's batch_size"):
        run(dataloader_kwargs={"batch_size": 4})
    with pytest.raises(ValueError, match="needs num_workers > 0"):
        run(dataloader_kwargs={"prefetch_factor": 4})


def test_factory_gets_the_originals_train_flag():
    seen = []

    def factory(rank, num_nodes, train_dataset):
        seen.append(train_dataset)
        return toy.make_classification(64 if train_dataset else 16)

    Trainer(toy.TinyMLP(), factory, factory).fit(1, SimpleReduceStrategy(), 2, 1, "cpu", batch_size=8,
                                                 progress=False, logger=False)
    assert seen.count(True) == 2 and seen.count(False) == 1  # two training shards, node 0's validation data


class PlaygroundSPARTA(Strategy):
    """playground.py's custom strategy: a shared Bernoulli mask from rank 0, averaged entries, masked_scatter_."""

    def __init__(self, optim_spec=None, p_sparta=0.005, **kwargs):
        index_selector = RandomIndexSelector(p_sparta)
        super().__init__(**kwargs)
        self.optim_spec = optim_spec if isinstance(optim_spec, OptimSpec) else OptimSpec.from_str(optim_spec)
        self.index_selector = index_selector

    def step(self):
        with torch.no_grad():
            for param in self.model.parameters():
                if not param.requires_grad or param.grad is None:
                    continue
                indices_mask = self.index_selector.get_indices(param, self.local_step)
                broadcast(indices_mask, src=0)
                sparse_data = param.data[indices_mask]
                all_reduce(sparse_data, op=torch.distributed.ReduceOp.SUM)
                sparse_data /= self.num_nodes
                param.masked_scatter_(indices_mask, sparse_data)
        self.optim.step()
        super().step()


def test_playground_custom_strategy(wandb_calls):
    assert get_device() == default_device().type and isinstance(get_device(), str)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a strategy of your own keeps p as an attribute, as the original: no warning
        strategy = PlaygroundSPARTA(optim_spec=OptimSpec(torch.optim.AdamW, lr=0.0004), lr_scheduler="lambda_cosine",
                                    lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True}, max_norm=1.0,
                                    p=0.005)
    assert strategy.p == 0.005
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
    trainer.fit(num_epochs=1, max_steps=3, strategy=strategy, num_nodes=4, device=get_device(), batch_size=16,
                minibatch_size=8, shuffle=False, val_size=32, val_interval=2, wandb_project="sparta",
                run_name="sparta-run", progress=False)
    assert wandb_calls[0] == ("start", "sparta", "sparta-run", "step")
    assert trainer.record.bytes_per_node[0] > 0


def test_diloco_scaling_fit_calls(wandb_calls):
    from exogym.strategy.diloco import DiLoCoStrategy
    for run_index, K in enumerate([0, 1, 2]):
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1),
                          start_port=12355 + run_index)
        schedule = dict(lr_scheduler="lambda_cosine", lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True},
                        max_norm=1.0)
        if K == 0:
            strategy, nodes, batch = SimpleReduceStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3),
                                                          **schedule), 1, 16
        else:
            strategy, nodes, batch = DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3), H=2,
                                                    **schedule), K, 16 // K
        trainer.fit(num_epochs=1, max_steps=4, strategy=strategy, num_nodes=nodes, device="cpu", batch_size=batch,
                    shuffle=True, val_size=32, val_interval=2, wandb_project="DiLoCo-Scaling", run_name=f"run{K}",
                    log_x_axis="examples", kwargs={"dataset_name": "shakespeare"}, progress=False)
        assert trainer.record.config["extra"] == {"dataset_name": "shakespeare"}  # fit(kwargs=...), recorded
        assert trainer.record.config["port"] == 12355 + run_index  # the rendezvous port of backend="torch"
    assert [c for c in wandb_calls if c[0] == "start"][-1] == ("start", "DiLoCo-Scaling", "run2", "examples")
    trainer.fit(SimpleReduceStrategy(), 2, max_steps=1, batch_size=8, logger=WandbLogger("mine", "r"),
                log_x_axis="examples", progress=False)  # a W&B logger passed in takes the x-axis too
    assert [c for c in wandb_calls if c[0] == "start"][-1] == ("start", "mine", "r", "examples")


def test_nanogpt_train_fit_call_with_the_scripts_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def owt_dataset_factory(name, block_size, start_pc, end_pc, val_start_pc, val_end_pc, rank, num_nodes,
                            train_dataset):
        return toy.make_classification(128 if train_dataset else 32, seed=rank if train_dataset else 99)

    factory = partial(owt_dataset_factory, "owt", 8, 0.0, 0.9, 0.9, 1.0)
    trainer = Trainer(toy.TinyMLP(), factory, factory, start_port=15000)
    model = trainer.fit(num_epochs=1, max_steps=3, strategy=SimpleReduceStrategy(
        optim_spec=OptimSpec(torch.optim.AdamW, lr=1e-3), lr_scheduler="lambda_cosine",
        lr_scheduler_kwargs={"warmup_steps": 1, "cosine_anneal": False}, max_norm=1.0), num_nodes=2, device="",
        batch_size=8, minibatch_size=None, shuffle=False, val_size=16, val_interval=2, correlation_interval=None,
        save_dir="./checkpoints", wandb_project=None, run_name="ddp_bs8", log_x_axis="step", progress=False)
    assert isinstance(model, toy.TinyMLP)
    assert not (tmp_path / "checkpoints").exists()  # save_dir without checkpoint_interval: nothing, as the original
    assert (tmp_path / "logs" / "ddp_bs8" / "train.csv").exists()


def test_mnist_sweep_loop_passes_every_strategy_H_and_p():
    from exogym.strategy.diloco import DiLoCoStrategy
    from exogym.strategy.sparta import SPARTAStrategy
    optim_spec = OptimSpec(torch.optim.AdamW, lr=3e-4, weight_decay=1e-4)
    for name, Strat in [("ddp", SimpleReduceStrategy), ("diloco", DiLoCoStrategy), ("sparta", SPARTAStrategy)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy = Strat(optim_spec=optim_spec, H=20, p=0.05, lr_scheduler="lambda_cosine",
                             lr_scheduler_kwargs={"warmup_steps": 2, "cosine_anneal": True})
        ignored = {"ddp": "H or p", "diloco": "p", "sparta": "H or p"}[name]
        assert any(f"has no {ignored}," in str(w.message) for w in caught)
        if name == "diloco":
            assert strategy.H == 20  # DiLoCo's own H is used
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(32, seed=1))
        trainer.fit(max_steps=3, num_epochs=5, strategy=strategy, num_nodes=4, device="cpu", batch_size=8,
                    val_size=32, val_interval=1, wandb_project=None, run_name=f"mnist_{name}", progress=False)
        assert open(f"logs/mnist_{name}/val.csv").readline().startswith("step,local_loss")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'Hh'"):
        SimpleReduceStrategy(Hh=20)  # anything else is still a typo


def test_trainer_fit_positional_order_and_errors():
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(64))
    trainer.fit(1, SimpleReduceStrategy(), 4, 2, "cpu", None, 8, 8, True, progress=False, logger=False)
    assert trainer.record.config["num_nodes"] == 4 and trainer.record.config["max_steps"] == 2
    trainer.fit(SimpleReduceStrategy(), 2, max_steps=1, batch_size=8, progress=False, logger=False)  # this library's
    with pytest.raises(TypeError, match="got multiple values for 'num_nodes'"):
        trainer.fit(1, SimpleReduceStrategy(), 4, num_nodes=2)
    with pytest.raises(TypeError, match="at most 2 positional arguments"):
        trainer.fit(SimpleReduceStrategy(), 2, 3)
    with pytest.raises(TypeError, match="got both correlation_interval= and diagnostics_interval="):
        trainer.fit(SimpleReduceStrategy(), 2, correlation_interval=1, diagnostics_interval=1)
    with pytest.raises(TypeError, match=r"'wandb_projet' \(did you mean 'wandb_project'\?\)"):
        trainer.fit(SimpleReduceStrategy(), 2, wandb_projet="x")
    with pytest.warns(UserWarning, match="log_x_axis='examples' has no effect: it sets the x-axis of W&B charts"):
        trainer.fit(SimpleReduceStrategy(), 2, max_steps=1, batch_size=8, log_x_axis="examples", progress=False,
                    logger=False)


def test_port_is_the_rendezvous_port_of_the_torch_backend():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(64))
        trainer.fit(SimpleReduceStrategy(), 2, max_steps=1, batch_size=8, port=port, progress=False,
                    logger=False)  # the sim has no rendezvous: harmless
        with pytest.raises(Exception, match=str(port)):  # the port is taken: the torch backend's store cannot listen
            trainer.fit(SimpleReduceStrategy(), 2, max_steps=1, batch_size=8, port=port, backend="torch",
                        progress=False, logger=False)
