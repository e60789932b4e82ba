"""Fused execution (exogym.backends.sim.fused): one batched forward/backward gives what K sequential ones give."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.backends.sim.fused import choose as choose_mod
from exogym.backends.sim.fused.choose import FusedFallbackWarning
from exogym.backends.sim.fused.engine import FusedEngine
from exogym.strategy import (CommunicateOptimizeStrategy, DeMoStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec,
                             SimpleReduceStrategy, SPARTADiLoCoStrategy, SPARTAStrategy, Strategy)
from exogym.comm.collectives import all_reduce, alive_ranks
from exogym.strategy import DiLoCoCommunicator, SparseCommunicator
from exogym.strategy.streaming_diloco import StreamingDiLoCoStrategy

FIT = dict(progress=False, device="cpu", logger=False, val_interval=1000)


class ReadmeStrategy(Strategy):
    """The README's custom strategy, dividing by the nodes up."""

    def __init__(self, optim_spec, **kwargs):
        super().__init__(**kwargs)
        self.optim_spec = optim_spec

    def step(self):
        for param in self.model.parameters():
            if param.grad is not None:
                all_reduce(param.grad)
                param.grad.div_(len(alive_ranks()))
        self.optim.step()
        super().step()


class Rebinding(ReadmeStrategy):
    """Rebinds p.data (as some user code does): the node's tensors leave the stack and must be taken back."""

    def step(self):
        super().step()
        for p in self.model.parameters():
            p.data = p.data * 0.99


STRATEGIES = {
    "ddp": lambda: SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2), max_norm=0.5),
    "diloco": lambda: DiLoCoStrategy(lr=1e-2, H=3),
    "fedavg-sampled": lambda: FedAvgStrategy(lr=0.1, H=2, client_sampling=0.5),
    "fedavg-islands": lambda: FedAvgStrategy(lr=0.1, H=2, island_size=2),
    "sparta": lambda: SPARTAStrategy(lr=1e-2, p_sparta=0.2),
    "sparta-diloco": lambda: SPARTADiLoCoStrategy(lr=1e-2, p_sparta=0.2, H=3),
    "demo": lambda: DeMoStrategy(lr=1e-2, compression_topk=4, compression_chunk=4),
    "streaming-diloco": lambda: StreamingDiLoCoStrategy(lr=1e-2, H=4, num_fragments=2),
    "hybrid": lambda: CommunicateOptimizeStrategy([SparseCommunicator(0.2), DiLoCoCommunicator(H=3)], "adamw",
                                                  lr=1e-2),
    "readme": lambda: ReadmeStrategy(OptimSpec(torch.optim.SGD, lr=0.1)),
    "rebinding": lambda: Rebinding(OptimSpec(torch.optim.SGD, lr=0.1)),
}


class BatchNormMLP(torch.nn.Module):
    """No randomness; BatchNorm running statistics are buffers each node updates."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))

    def forward(self, batch):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def _fit(execution, make, model=None, nodes=4, steps=8, data=None, **kw):
    trainer = Trainer(model or toy.TinyMLP(), data or toy.make_classification(256))
    out = trainer.fit(make(), nodes, batch_size=8, max_steps=steps, execution=execution,
                      **{**FIT, "network": "low", **kw})
    return out, trainer.record


def _same_run(seq, fused, rtol=1e-5, atol=1e-6):
    (m1, r1), (m2, r2) = seq, fused
    assert_close(torch.cat([t.flatten().float() for t in m2.state_dict().values()]),
                 torch.cat([t.flatten().float() for t in m1.state_dict().values()]), rtol=rtol, atol=atol)
    assert r2.bytes_per_node == r1.bytes_per_node  # per node, unchanged
    assert r2.sim_time_s == r1.sim_time_s and r2.sim_time_per_node == r1.sim_time_per_node
    assert_close(torch.tensor(r2.column("loss")), torch.tensor(r1.column("loss")), rtol=rtol, atol=1e-6)
    assert r2.config["execution"] == "fused" and r1.config["execution"] == "sequential"


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_fused_equals_sequential(name):
    _same_run(_fit("sequential", STRATEGIES[name]), _fit("fused", STRATEGIES[name]))


def test_batchnorm_buffers_accumulation_and_clipping_per_node():
    make = lambda: SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1), max_norm=0.1)  # noqa: E731
    seq = _fit("sequential", make, BatchNormMLP(), minibatch_size=4)
    fused = _fit("fused", make, BatchNormMLP(), minibatch_size=4)
    _same_run(seq, fused)
    assert seq[0].state_dict()["net.1.num_batches_tracked"] == fused[0].state_dict()["net.1.num_batches_tracked"] == 16
    assert not torch.equal(fused[0].state_dict()["net.1.running_mean"], torch.zeros(16))


def test_failures_elastic_pool_and_per_node_data():
    datasets = [toy.make_classification(128, seed=r) for r in range(4)]
    factory = lambda rank, num_nodes, is_val: datasets[rank]  # noqa: E731
    make = STRATEGIES["readme"]
    kw = dict(failures=[(1, 3, 6), (2, 5, None)], steps=10)
    _same_run(_fit("sequential", make, data=factory, **kw), _fit("fused", make, data=factory, **kw))
    kw = dict(active_nodes=[(1, 1), (4, 3), (7, 4)], steps=10)
    _same_run(_fit("sequential", make, **kw), _fit("fused", make, **kw))


def test_only_the_nodes_that_compute_join_the_batched_step(monkeypatch):
    sizes = []
    original = FusedEngine.run_group

    def spy(self, group):
        sizes.append([w.rank for w in group])
        return original(self, group)

    monkeypatch.setattr(FusedEngine, "run_group", spy)
    _fit("fused", lambda: FedAvgStrategy(lr=0.1, H=2, client_sampling=0.5), steps=6, network=None)
    assert [len(s) for s in sizes[1:]] == [2] * 6  # after the probe's group of 4: the 2 sampled clients each step
    assert len({tuple(s) for s in sizes[1:]}) > 1  # different clients in different rounds (gathered, not a slice)
    sizes.clear()
    _fit("fused", STRATEGIES["readme"], steps=6, network=None, failures=[(2, 2, 4)])
    assert [len(s) for s in sizes[1:]] == [4, 3, 3, 4, 4, 4]


def test_autocast_fused_matches_sequential_to_bfloat16_rounding():
    seq = _fit("sequential", STRATEGIES["ddp"], autocast=True, network=None)
    fused = _fit("fused", STRATEGIES["ddp"], autocast=True, network=None)
    assert_close(toy.params(fused[0]), toy.params(seq[0]), rtol=2e-2, atol=2e-3)


def test_dropout_is_deterministic_and_its_streams_are_the_fused_ones():
    runs = [_fit(ex, STRATEGIES["ddp"], toy.TinyMLP(dropout=0.3), network=None) for ex in ("fused", "fused",
                                                                                           "sequential")]
    (a, ra), (b, rb), (c, _) = runs
    assert all(torch.equal(x, y) for x, y in zip(toy.params(a), toy.params(b))) and ra.node_loss == rb.node_loss
    assert not all(torch.equal(x, y) for x, y in zip(toy.params(a), toy.params(c)))  # documented: other masks


def test_a_fused_run_resumes_fused_bit_identically(tmp_path):
    model = lambda: toy.TinyMLP(dropout=0.3)  # noqa: E731
    make = lambda: DiLoCoStrategy(lr=1e-2, H=3)  # noqa: E731
    full, _ = _fit("fused", make, model(), steps=10, network=None)
    _fit("fused", make, model(), steps=10, network=None, checkpoint_interval=4, checkpoint_dir=tmp_path / "ck")
    files = sorted((tmp_path / "ck").glob("step_*4/node*.pt"))
    assert len(files) == 4 and max(f.stat().st_size for f in files) < 2 * min(f.stat().st_size for f in files)
    seq_dir = tmp_path / "seq"
    _fit("sequential", make, model(), steps=4, network=None, checkpoint_interval=4, checkpoint_dir=seq_dir)
    seq_size = next(seq_dir.glob("step_*/node1.pt")).stat().st_size
    assert files[1].stat().st_size < 1.2 * seq_size  # a node's file holds its own slots, not the whole stacks
    resumed, record = _fit("auto", make, model(), steps=10, network=None,
                           resume_from=tmp_path / "ck" / "step_000000004")
    assert record.config["execution"] == "fused"
    assert all(torch.equal(x, y) for x, y in zip(toy.params(resumed), toy.params(full)))


def test_attention_runs_batched_without_vmap_fallback():
    from exogym.models.gpt import GPT

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (64, 9), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    make = lambda: SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-3))  # noqa: E731
    model = lambda: (torch.manual_seed(0), GPT(11, 8, n_layer=1, n_head=2, n_embd=16))[1]  # noqa: E731
    seq = _fit("sequential", make, model(), data=data, network=None, steps=4, nodes=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule.*")
        fused = _fit("fused", make, model(), data=data, network=None, steps=4, nodes=2)
    _same_run(seq, fused, rtol=1e-4)


class DataDependent(toy.TinyMLP):
    def forward(self, batch):
        out = super().forward(batch)
        if out["loss"] > 0:  # Python control flow on a value: vmap cannot batch it
            return out
        return out


def test_a_model_vmap_cannot_run_is_named_under_fused_and_falls_back_under_auto():
    with pytest.raises(ValueError, match="execution=.fused. cannot run.*Python control flow.*data-dependent"):
        _fit("fused", STRATEGIES["ddp"], DataDependent(), network=None)
    with pytest.warns(FusedFallbackWarning, match="runs the nodes sequentially: its forward uses a tensor") as caught:
        _, record = _fit("auto", STRATEGIES["ddp"], DataDependent(), network=None)
    assert len([w for w in caught if issubclass(w.category, FusedFallbackWarning)]) == 1
    assert record.config["execution"] == "sequential"


def test_bad_execution_arguments_are_rejected_before_any_node_starts():
    with pytest.raises(ValueError, match=r"execution must be one of \['sequential', 'fused', 'auto'\], got 'fast'"):
        _fit("fast", STRATEGIES["ddp"])
    with pytest.raises(ValueError, match="one device.*cpu:0.*cpu:1|one device"):
        _fit("fused", STRATEGIES["ddp"], network=None, device=None, devices=["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match="backend='sim'"):
        _fit("fused", STRATEGIES["ddp"], network=None, backend="torch")


@pytest.mark.parametrize("fused_s, chosen", [(0.5, "fused"), (0.97, "sequential")])
def test_auto_fuses_only_where_the_probe_measured_it_faster(monkeypatch, fused_s, chosen):
    monkeypatch.setattr(choose_mod, "_probe", lambda *a, timed, **k: (fused_s, 1.0) if timed else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, record = _fit("auto", STRATEGIES["ddp"], network=None, steps=2)
    assert record.config["execution"] == chosen
    assert ("probe" in record.config["execution_reason"])
    assert len([w for w in caught if issubclass(w.category, FusedFallbackWarning)]) == (chosen == "sequential")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one GPU hosts every fused node)")
def test_fused_on_one_gpu_equals_sequential():
    seq = _fit("sequential", STRATEGIES["diloco"], BatchNormMLP(), device="cuda", network=None)
    fused = _fit("fused", STRATEGIES["diloco"], BatchNormMLP(), device="cuda", network=None)
    _same_run(seq, fused, rtol=1e-4)


def test_a_transformers_model_called_with_keywords_fuses():
    """A Hugging Face causal LM: a dict batch goes in as model(**batch) and a ModelOutput comes back."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=12, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))

    ids = torch.randint(0, 12, (64, 8), generator=torch.Generator().manual_seed(0))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    runs = [_fit(ex, STRATEGIES["diloco"], gpt2(), data=Tokens(), steps=4, network=None)
            for ex in ("sequential", "fused")]
    _same_run(*runs, rtol=1e-4, atol=1e-5)  # the batched matmuls round differently; weights are O(0.02)


@pytest.mark.parametrize("spec, kernel", [(OptimSpec(torch.optim.AdamW, lr=1e-2), True),
                                          (OptimSpec(torch.optim.SGD, lr=0.1, momentum=0.9), True),
                                          (OptimSpec(torch.optim.AdamW, lr=1e-2, foreach=False), None),
                                          (OptimSpec(torch.optim.AdamW, lr=1e-2, fused=False), False)])
def test_fused_runs_step_with_the_fused_kernel_unless_the_optimizer_names_its_own(spec, kernel, monkeypatch):
    """An SGD / Adam / AdamW that leaves the implementation to torch steps with its fused kernel under fused
    execution (one pass instead of one per op); one that names foreach or fused keeps what it named; sequential
    runs keep the optimizer as it was built. Each node steps its own optimizer either way."""
    seen = {"fused": [], "sequential": []}
    original = spec.cls.step
    for execution in seen:
        monkeypatch.setattr(spec.cls, "step", lambda self, *a, _e=execution, **k: (
            seen[_e].extend(g["fused"] for g in self.param_groups), original(self, *a, **k))[1])
        _fit(execution, lambda: SimpleReduceStrategy(spec), steps=2, network=None)
    # The training's steps come last (the fused run's probe steps throwaway copies first): 4 nodes' own, 2 each.
    assert len(seen["fused"]) >= 2 * 4 and set(seen["fused"][-2 * 4:]) == {kernel}
    assert seen["sequential"] == [spec.kwargs.get("fused")] * 2  # the one replica's, as built


@pytest.mark.parametrize("rows, strided_path", [(4, True), (64, False)])
def test_batched_linear_gives_the_weight_gradient_in_the_parameters_layout(rows, strided_path):
    """Where a node's rows are few (rows x (in + out) <= in x out), the batched template's nn.Linear computes
    (W x^T)^T: the stacked weight gradient comes back contiguous (no transposing copy before the optimizer);
    elsewhere it keeps F.linear. Either way, the values are F.linear's."""
    from torch.func import functional_call, vmap

    from exogym.backends.sim.fused.layers import batching_friendly

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(24, 16))
    fast = batching_friendly(plain)
    k = 3
    x = torch.randn(k, rows, 24)

    def grads(module):  # as the engine takes them: a vmapped forward, one autograd.grad over the stacks
        stacks = {n: torch.randn(k, *p.shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
                  for n, p in module.named_parameters()}
        out = vmap(lambda p, xs: functional_call(module, p, (xs,)))(stacks, x)
        return dict(zip(stacks, torch.autograd.grad((out ** 2).sum(), list(stacks.values()))))

    got, want = grads(fast), grads(plain)
    for name in want:
        assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    assert got["0.weight"].is_contiguous() == strided_path
    assert not want["0.weight"].is_contiguous()  # what F.linear under vmap gives: the transpose
