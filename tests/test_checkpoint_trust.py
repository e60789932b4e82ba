"""A checkpoint belongs to one run: resume continues exactly that run or refuses, loading runs no code, and the
files are verified; every strategy resumes bit-identically."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.runs.checkpoint import CheckpointError
from exogym.comm.compression import ErrorFeedback, IntQuantizer, TopK
from exogym.runs.loggers import Logger
from exogym.strategy import (AveragingCommunicator, CommunicateOptimizeStrategy, DeMoStrategy, DGCStrategy,
                             DiLoCoStrategy, FedAvgStrategy, OptimSpec, SimpleReduceStrategy, SPARTADiLoCoStrategy,
                             SPARTAStrategy, StreamingDiLoCoStrategy)

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8, val_interval=5)


def _trainer(hidden=16):
    return Trainer(toy.TinyMLP(hidden=hidden, dropout=0.2), toy.make_classification(96),
                   toy.make_classification(24, seed=1))


def _ddp(lr=1e-2):
    return SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=lr), warmup_steps=2, cosine_anneal=True)


def _checkpointed(tmp_path, strategy=None, steps=8, **kwargs):
    _trainer().fit(strategy or _ddp(), 2, max_steps=steps, checkpoint_interval=4, checkpoint_dir=tmp_path,
                   **{**FIT, **kwargs})
    return tmp_path / "step_000000004"


class _Rows(Logger):
    def __init__(self):
        self.rows = []

    def log(self, table, row):
        self.rows.append(row)


@pytest.mark.parametrize("change, key", [
    (dict(strategy=DiLoCoStrategy(H=2)), "strategy_config.name"),
    (dict(strategy=_ddp(lr=2e-2)), "strategy_config.optim_spec"),
    (dict(seed=7), "seed"),
    (dict(partition="dirichlet", dirichlet_alpha=0.5), "partition"),
    (dict(max_steps=12), "max_steps"),
    (dict(trainer=_trainer(hidden=12)), "model.state"),
])
def test_resume_refuses_a_different_run_before_any_node_starts(tmp_path, change, key):
    ckpt = _checkpointed(tmp_path)
    change = dict(change)
    trainer, strategy = change.pop("trainer", _trainer()), change.pop("strategy", _ddp())
    rows = _Rows()
    kwargs = {**FIT, "max_steps": 8, **change, "logger": rows}
    with pytest.raises(CheckpointError, match=rf"different run configuration(.|\n)*  {key}\S*: checkpoint "):
        trainer.fit(strategy, 2, resume_from=ckpt, **kwargs)
    assert rows.rows == []  # refused before any node trained a step


def test_a_longer_run_needs_extend_run_and_the_record_says_what_the_schedule_did(tmp_path):
    ckpt = _checkpointed(tmp_path)
    with pytest.raises(CheckpointError, match="extend_run=True"):
        _trainer().fit(_ddp(), 2, max_steps=12, resume_from=ckpt, **FIT)
    t = _trainer()
    t.fit(_ddp(), 2, max_steps=12, resume_from=ckpt, extend_run=True, **FIT)
    extended = t.record.config["resumed"]["extended"]
    assert extended["from_max_steps"] == 8 and extended["to_max_steps"] == 12
    lrs = t.record.column("lr")
    assert lrs[-1] == lrs[-2] == lrs[-4]  # the 8-step cosine ended: its last rate continues, as the record says
    with pytest.raises(TypeError, match="extend_run=True .* needs resume_from"):
        _trainer().fit(_ddp(), 2, max_steps=8, extend_run=True, **FIT)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {Path.cwd() / 'payload-ran'}",))


def test_loading_a_crafted_file_runs_no_code(tmp_path):
    ckpt = _checkpointed(tmp_path)
    crafted = ckpt / "node0.pt"
    with open(crafted, "wb") as f:
        pickle.dump({"format": 2, "model": _Payload()}, f)
    _rehash(ckpt, "node0.pt")  # the manifest vouches for it: only the loader stands in the way
    with pytest.raises(CheckpointError, match=r"node0.pt' does not hold an exogym node state"):
        _trainer().fit(_ddp(), 2, max_steps=8, resume_from=ckpt, **FIT)
    assert not (Path.cwd() / "payload-ran").exists()


def test_a_flipped_bit_swapped_files_and_a_malformed_manifest_are_errors_naming_the_file(tmp_path):
    ckpt = _checkpointed(tmp_path)
    data = bytearray((ckpt / "node1.pt").read_bytes())
    data[len(data) // 2] ^= 0x10
    (ckpt / "node1.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"node1.pt' is missing, truncated or corrupted"):
        _trainer().fit(_ddp(), 2, max_steps=8, resume_from=ckpt, **FIT)

    ckpt = _checkpointed(tmp_path / "again")
    a, b = (ckpt / "node0.pt").read_bytes(), (ckpt / "node1.pt").read_bytes()
    (ckpt / "node0.pt").write_bytes(b), (ckpt / "node1.pt").write_bytes(a)
    with pytest.raises(CheckpointError, match=r"node0.pt' is missing, truncated or corrupted"):
        _trainer().fit(_ddp(), 2, max_steps=8, resume_from=ckpt, **FIT)
    _rehash(ckpt, "node0.pt"), _rehash(ckpt, "node1.pt")  # a manifest rewritten to match: the ranks inside differ
    with pytest.raises(CheckpointError, match=r"node0.pt' holds node 1's state"):
        _trainer().fit(_ddp(), 2, max_steps=8, resume_from=ckpt, **FIT)

    (ckpt / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"manifest.json' is malformed: missing or wrong format"):
        _trainer().fit(_ddp(), 2, max_steps=8, resume_from=ckpt, **FIT)


def _rehash(ckpt, name):
    import hashlib
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name]["sha256"] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def test_a_second_run_never_prunes_or_mixes_with_anothers_checkpoints(tmp_path):
    _checkpointed(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match="holds checkpoints of another run"):
        _checkpointed(tmp_path, steps=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # Resuming that very run keeps writing there, and prunes only its own.
    _trainer().fit(_ddp(), 2, max_steps=8, resume_from=tmp_path / "step_000000004", checkpoint_interval=4,
                   checkpoint_dir=tmp_path, keep_checkpoints=1, **FIT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000008"]


def test_resume_from_accepts_the_run_folder():
    _trainer().fit(_ddp(), 2, max_steps=8, checkpoint_interval=4, run_name="r", **FIT)
    t = _trainer()
    t.fit(_ddp(), 2, max_steps=12, resume_from=Path("logs") / "r", extend_run=True, **FIT)
    assert t.record.config["resumed"]["step"] == 8


class _Watch(SimpleReduceStrategy):
    MODELS: dict = {}

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.MODELS[rank] = model


def test_the_global_model_of_identical_replicas_is_bit_equal_to_them():
    for k in (3, 5, 6):
        model = toy.TinyMLP(dim=8, hidden=33)
        model.net[0].requires_grad_(False)  # a frozen layer: averaging k equal copies does not round-trip exactly
        returned = Trainer(model, toy.make_classification(240)).fit(_Watch(lr=0.05), k, max_steps=3,
                                                                   **{**FIT, "val_interval": 1})
        for node in _Watch.MODELS.values():
            assert all(torch.equal(a, b) for a, b in zip(returned.parameters(), node.parameters()))


class _NoSuper(SimpleReduceStrategy):
    def __init__(self):
        self.optim_spec = OptimSpec(torch.optim.SGD, lr=0.1)


class _NoOptimizer(SimpleReduceStrategy):
    def __init__(self):
        super().__init__()
        self.optim_spec = None


def test_custom_strategy_mistakes_say_the_fix():
    with pytest.raises(TypeError, match=r"call super\(\).__init__\(...\) in _NoSuper.__init__"):
        _trainer().fit(_NoSuper(), 2, max_steps=2, **FIT)
    with pytest.raises(TypeError, match=r"set self.optim_spec in _NoOptimizer.__init__ .* or build self.optim in "
                                        r"_init_node"):
        _trainer().fit(_NoOptimizer(), 2, max_steps=2, **FIT)


STRATEGIES = {
    "ddp": lambda: _ddp(),
    "diloco-ef": lambda: DiLoCoStrategy(H=3, lr=1e-2, compression=ErrorFeedback(TopK(0.3, values=IntQuantizer()))),
    "streaming-in-flight": lambda: StreamingDiLoCoStrategy(H=4, num_fragments=2, tau=1, lr=1e-2),
    "sparta-async": lambda: SPARTAStrategy(lr=1e-2, p_sparta=0.2, async_delay=2),
    "sparta-topk": lambda: SPARTAStrategy(lr=1e-2, p_sparta=0.2, compression_method="topk"),
    "fedavg-sampling": lambda: FedAvgStrategy(H=3, lr=0.1, client_sampling=0.5),
    "sparta-diloco": lambda: SPARTADiLoCoStrategy(lr=1e-2, p_sparta=0.2, H=3),
    "averaging-int8": lambda: CommunicateOptimizeStrategy([AveragingCommunicator(2, quantization_bits=8)], lr=1e-2),
    "demo": lambda: DeMoStrategy(lr=1e-3, warmup_steps=2),
    "dgc": lambda: DGCStrategy(lr=1e-2, target_sparsity=0.05, warmup_steps=4, clip_threshold=1.0),
    "custom": lambda: toy.LocalOnly(lr=0.1),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_resumes_bit_identically(tmp_path, name):
    toy.assert_resumes_bit_identically(STRATEGIES[name], _trainer, tmp_path, **FIT)
