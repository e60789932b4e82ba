"""Every spelling of the long README (../shared/seeds/001_*): quick starts, the modular framework, logging,
configuration, custom strategies, dataset factories, memory options, extras, example commands, tutorials."""

import importlib.util
import runpy
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

import toy
from exogym import LocalTrainer
from exogym.logger import Logger, WandbLogger
from exogym.strategy import (CommunicateOptimizeStrategy, DeMoStrategy, DiLoCoStrategy, FedAvgStrategy,
                             SimpleReduceStrategy, SPARTAStrategy, Strategy)
from exogym.strategy.federated_averaging import AveragingCommunicator
from exogym.strategy.sparta import SparseCommunicator, TopKSparseCommunicator

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(progress=False, device="cpu", logger=False)


def _trainer(n=256):
    torch.manual_seed(0)
    return LocalTrainer(toy.TinyMLP(), toy.make_classification(n), toy.make_classification(32, seed=1))


def test_quick_start_strategies_and_fit_calls():
    t = _trainer()
    t.fit(strategy=DiLoCoStrategy(inner_optim="adamw", outer_optim="sgd", H=100, lr=3e-4), num_nodes=4, num_epochs=1,
          batch_size=32, **QUIET)
    fed = FedAvgStrategy(inner_optim="sgd", island_size=4, H=5, lr=0.01)
    t = _trainer(16 * 8 * 2)
    t.fit(strategy=fed, num_nodes=16, num_epochs=2, batch_size=8, **QUIET)  # 4 islands of 4
    assert t.record.config["max_steps"] == 4
    t = _trainer()
    t.fit(strategy=SPARTAStrategy(p_sparta=0.001, inner_optim="adamw", lr=1e-4), num_nodes=8, num_epochs=1,
          batch_size=8, **QUIET)
    demo = DeMoStrategy(compression_decay=0.999, compression_topk=32, compression_chunk=64, weight_decay=1e-4)
    _trainer().fit(strategy=demo, num_nodes=4, max_steps=2, **QUIET)


def test_modular_framework_with_sparsification_rate():
    sparse = SparseCommunicator(sparsification_rate=0.01)
    assert sparse.p_sparta == 0.01
    strategy = CommunicateOptimizeStrategy(communication_modules=[sparse, AveragingCommunicator(island_size=4)],
                                           inner_optim="adamw")
    _trainer().fit(strategy, 4, max_steps=2, batch_size=8, **QUIET)
    with pytest.raises(TypeError, match="sparsification_rate is the original EXO Gym's name for p_sparta"):
        SparseCommunicator(p_sparta=0.1, sparsification_rate=0.1)


class Recording(Logger):
    def __init__(self):
        self.steps = []

    def log(self, table, row):
        if table == "train":
            self.steps.append(int(row["step"]))


def test_logging_snippet_fit_without_num_nodes_logs_every_50_steps():
    lg = Recording()
    t = _trainer(4096)
    t.fit(strategy=SimpleReduceStrategy(), logger=lg, log_interval=50, max_steps=120, progress=False, device="cpu")
    assert t.record.config["num_nodes"] == 1  # num_nodes defaults to one node
    assert lg.steps == [50, 100, 120] and len(t.record.train) == 120  # the record keeps every step


@pytest.mark.spawns
def test_wandb_logger_with_experiment_name_runs_offline_without_network(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no W&B key, as on a machine without an account
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(project="distributed_training_research", experiment_name="diloco_vs_sparta_comparison")
    assert logger.run_name == "diloco_vs_sparta_comparison"
    _trainer().fit(strategy=DiLoCoStrategy(H=2), logger=logger, log_interval=50, max_steps=3, progress=False,
                   device="cpu", batch_size=8)
    assert logger.run.settings.mode == "offline" and logger.run.name == "diloco_vs_sparta_comparison"
    # wandb reads WANDB_DIR once per process, so an earlier test's may hold: the run's own folder says where it went.
    assert Path(logger.run.dir).parent.name.startswith("offline-run-") and Path(logger.run.dir).is_dir()


def test_strategy_configuration_snippet_cosine_schedule_recorded_canonically():
    s = DiLoCoStrategy(inner_optim="adamw", outer_optim="sgd", H=200, inner_lr=1e-4, outer_lr=0.5, max_norm=1.0,
                       lr_scheduler="cosine", warmup_steps=1000)
    assert (s.lr_schedule.kind, s.lr_schedule.warmup_steps, s.lr_schedule.cosine_anneal) == ("lambda_cosine", 1000,
                                                                                              True)
    assert s.optim_spec.kwargs == {"lr": 1e-4} and s.modules[0].outer_optim_spec.kwargs["lr"] == 0.5
    config = s.config()
    assert config["lr_scheduler"] == "lambda_cosine" and config["cosine_anneal"] is True


class Custom(Strategy):
    """The long README's template: communicate_gradients(), update_parameters()."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    def step(self):
        self.communicate_gradients()
        self.update_parameters()
        super().step()


def test_custom_strategy_helpers_are_ddp_with_clipping():
    def run(strategy):
        return _trainer().fit(strategy, 3, max_steps=4, batch_size=8, **QUIET).state_dict()
    custom = run(Custom(optim_spec="sgd", max_norm=0.05))
    ddp = run(SimpleReduceStrategy("sgd", max_norm=0.05))
    torch.testing.assert_close(custom, ddp, rtol=1e-6, atol=1e-7)  # DDP's replica vs the mean of equal replicas
    unclipped = run(Custom(optim_spec="sgd"))
    assert max((a - b).abs().max() for a, b in zip(custom.values(), unclipped.values())) > 1e-4


def test_dataset_factory_with_the_readmes_parameter_names():
    full = toy.make_classification(256)
    seen = []

    def dataset_factory(rank, num_nodes, train_dataset):
        seen.append((rank, train_dataset))
        return Subset(full, list(range(rank, len(full), num_nodes)))

    trainer = LocalTrainer(model=toy.TinyMLP(), train_dataset=dataset_factory, val_dataset=toy.make_classification(32))
    trainer.fit(SimpleReduceStrategy(), 2, max_steps=2, batch_size=8, **QUIET)
    assert sorted(seen) == [(0, True), (1, True)]  # the original's convention: train_dataset=True for training data


def test_memory_snippet_gradient_accumulation_and_max_memory_usage():
    a = _trainer()
    a.fit(strategy=SimpleReduceStrategy("sgd"), batch_size=32, gradient_accumulation=4, max_steps=3, **QUIET)
    b = _trainer()
    b.fit(strategy=SimpleReduceStrategy("sgd"), batch_size=32, minibatch_size=8, max_steps=3, **QUIET)
    assert a.record.config["minibatch_size"] == 8
    assert [r["loss"] for r in a.record.train] == [r["loss"] for r in b.record.train]
    with pytest.raises(ValueError, match="gradient_accumulation=3 must divide batch_size=32"):
        _trainer().fit(strategy=SimpleReduceStrategy(), batch_size=32, gradient_accumulation=3, **QUIET)
    with pytest.raises(ValueError, match="max_memory_usage=0.8 caps GPU memory .* nodes on cpu have no such cap"):
        _trainer().fit(strategy=SimpleReduceStrategy(), batch_size=32, gradient_accumulation=4, max_memory_usage=0.8,
                       **QUIET)
    with pytest.raises(ValueError, match=r"in \(0, 1\]; got 1.5"):
        _trainer().fit(strategy=SimpleReduceStrategy(), max_memory_usage=1.5, **QUIET)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="max_memory_usage caps CUDA memory; no GPU here")
def test_max_memory_usage_caps_the_gpu():
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(torch.cuda.OutOfMemoryError):
        class Big(toy.TinyMLP):
            def forward(self, batch):
                torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")
                return super().forward(batch)
        LocalTrainer(Big(), toy.make_classification(64)).fit(SimpleReduceStrategy(), 1, max_steps=1, batch_size=8,
                                                             max_memory_usage=0.1, progress=False, logger=False,
                                                             device="cuda")


def test_communication_and_hardware_snippets():
    s = SPARTAStrategy(p_sparta=0.005, compression_method="topk", quantization_bits=8)
    assert isinstance(s.modules[0], TopKSparseCommunicator) and s.modules[0].compression.bits == 8
    assert DiLoCoStrategy(H=50).H == 50 and DiLoCoStrategy(H=200).H == 200


def test_documented_extras_exist():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"wandb", "gpt", "demo", "examples", "all", "dev"} <= set(extras)
    names = {req.split("[")[0].split("=")[0].split(">")[0] for req in extras["all"]}
    assert {"wandb", "tensorboard", "matplotlib"} <= names


def _load(path):
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


@pytest.mark.parametrize("name", ["tutorial_basic", "tutorial_strategies", "tutorial_custom"])
def test_tutorials_run(name):
    result = _load(ROOT / "run" / f"{name}.py").main(steps=20)
    assert result


def test_production_tutorial_resumes_bit_identically(tmp_path):
    result = _load(ROOT / "run" / "tutorial_production.py").main(steps=8, out=tmp_path, real_processes=False)
    assert result["identical"] and result["sim_time_s"] > 0


def _write_fake_cifar(folder: Path, n: int = 64):
    import pickle

    import numpy as np
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, n))}
        (folder / name).write_bytes(pickle.dumps({k: (v if k == b"data" else [int(x) for x in v])
                                                  for k, v in batch.items()}))


def test_example_commands_exist_and_parse_their_flags(tmp_path, monkeypatch, capsys):
    for script in ("mnist.py", "nanogpt_diloco.py", "cifar10_comparison.py", "federated_mnist.py"):
        assert (ROOT / "run" / script).exists()
    monkeypatch.syspath_prepend(str(ROOT / "run"))
    monkeypatch.setattr(sys, "argv", ["federated_mnist.py", "--num_clients", "100", "--island_size", "10", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "run" / "federated_mnist.py"), run_name="__main__")
    assert done.value.code == 0 and "--island_size" in capsys.readouterr().out
    cifar = _load(ROOT / "run" / "cifar10_comparison.py")
    monkeypatch.setattr(sys, "argv", ["cifar10_comparison.py", "--data", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match=r"cs\.toronto\.edu/~kriz/cifar\.html"):
        cifar.main()
    _write_fake_cifar(tmp_path / "cifar-10-batches-py")
    monkeypatch.setattr(sys, "argv", ["cifar10_comparison.py", "--data", str(tmp_path), "--steps", "1"])
    cifar.main()
    out = capsys.readouterr().out
    assert "DiLoCo H=20" in out and "DeMo" in out
