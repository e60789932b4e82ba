"""The model contract: how the node calls the model (model(batch) or model(**batch)) and reads its output."""

import math
import re
import traceback
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

import toy
from exogym import Trainer
from exogym.data.sharding import NodeBatches
from exogym.engine.model_call import parse_model_output, takes_keyword_batch
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu", logger=False)
SGD = OptimSpec(torch.optim.SGD, lr=0.1)


def _fit(model, train, val=None, nodes=1, **kwargs):
    t = Trainer(model, train, val)
    args = dict(batch_size=8, max_steps=2, shuffle=False, **FIT)
    args.update(kwargs)
    out = t.fit(SimpleReduceStrategy(SGD), nodes, **args)
    return out, t.record


def test_a_plain_classifier_is_stopped_at_the_first_step_with_the_contract_and_a_wrapper():
    with pytest.raises(TypeError) as info:
        _fit(torch.nn.Linear(8, 3), toy.make_classification(64))
    message = str(info.value)
    assert "must be Tensor, not tuple" in message  # what torch said
    assert "Trainer calls model(batch) with the whole batch" in message
    assert 'scalar loss tensor, or a dict (or an object) holding "loss"' in message
    assert "class WithLoss(torch.nn.Module)" in message and "cross_entropy(self.net(x), y)" in message
    assert info.value.__notes__ == ["(raised in node 0 at step 1)"]


def test_the_wrapper_the_message_shows_works():
    namespace = {"torch": torch}
    message = ""
    try:
        _fit(torch.nn.Linear(8, 3), toy.make_classification(64))
    except TypeError as e:
        message = str(e)
    code = "\n".join(line[4:] for line in message.splitlines() if line.startswith("    "))
    exec(code, namespace)  # the three lines, as printed
    _, record = _fit(namespace["WithLoss"](torch.nn.Linear(8, 3)), toy.make_classification(64))
    assert len(record.train) == 2 and all(math.isfinite(r["loss"]) for r in record.train)


def test_logits_are_detected_at_the_first_step_also_in_validation():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 3)

        def forward(self, batch):
            return self.net(batch[0])

    # With validation data, the first call is the step-0 evaluation.
    with pytest.raises(TypeError, match=r"(?s)returned a tensor of shape \(8, 3\), not a loss.*class WithLoss"):
        _fit(Logits(), toy.make_classification(64), toy.make_classification(16))


class _KeywordModel(torch.nn.Module):
    """Like a transformers model: forward(input_ids=..., labels=...) -> an object with .loss and .logits."""

    Output = namedtuple("Output", "loss logits aux")

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10)

    def forward(self, input_ids=None, labels=None, attention_mask=None):
        logits = self.head(self.emb(input_ids))  # [B, T, 10]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return self.Output(loss, logits, (logits.argmax(-1) == labels).float().mean())


class _Rows(Dataset):
    def __init__(self, n=32, t=5):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 10, (n, t + 1), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i, :-1], "labels": self.ids[i, 1:]}


def test_a_dict_batch_goes_in_as_keywords_when_the_forward_names_its_keys():
    data = _Rows()
    model, record = _fit(_KeywordModel(), data, data, batch_size=4, max_steps=3)
    first = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    expected = _KeywordModel()(**first)
    assert math.isclose(record.train[0]["loss"], expected.loss.item(), rel_tol=1e-6)
    assert math.isclose(record.train[0]["aux"], expected.aux.item(), rel_tol=1e-6)  # a scalar field is a metric
    assert "logits" not in record.train[0] and "global_aux" in record.val[0]  # non-scalars are not
    assert record.train[0]["tokens"] == 4 * 5


def test_the_calling_rule():
    class TakesBatch(torch.nn.Module):
        def forward(self, batch):
            return batch

    class TakesAnything(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return args

    ids = {"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3)}
    assert takes_keyword_batch(_KeywordModel(), ids)
    assert not takes_keyword_batch(_KeywordModel(), {**ids, "extra": torch.zeros(2)})  # a key forward lacks
    assert not takes_keyword_batch(TakesBatch(), {"batch": torch.zeros(1)} | ids)
    assert not takes_keyword_batch(TakesAnything(), ids)  # no named parameters: model(batch)
    assert not takes_keyword_batch(_KeywordModel(), (torch.zeros(2), torch.zeros(2)))


def test_a_column_the_forward_does_not_take_is_named():
    class WithText(_Rows):
        def __getitem__(self, i):
            return {**super().__getitem__(i), "length": torch.tensor(5)}

    with pytest.raises(TypeError, match=r"but not \['length'\]; drop those columns.*remove_columns"):
        _fit(_KeywordModel(), WithText(), batch_size=4)


def test_outputs_holding_a_loss():
    w = torch.ones((), requires_grad=True)
    loss = w * 2

    class Out:
        def __init__(self):
            self.loss, self.logits, self.accuracy, self.note = loss, torch.zeros(4, 3), 0.5, "text"

    for out in (Out(), {"loss": loss, "logits": torch.zeros(4, 3), "accuracy": 0.5, "cache": None}):
        got, metrics = parse_model_output(out)
        assert got is not None and got.item() == 2.0 and set(metrics) == {"accuracy"}
        assert metrics["accuracy"].item() == 0.5
    with pytest.raises(TypeError, match="without a 'loss' entry"):
        parse_model_output({"logits": torch.zeros(2)})
    with pytest.raises(TypeError, match="does not require grad"):
        parse_model_output({"loss": loss.detach()})
    assert parse_model_output({"loss": loss.detach()}, training=False)[0].item() == 2.0


def test_a_nan_error_names_one_step_the_right_one():
    class Explodes(toy.TinyMLP):
        def forward(self, batch):
            self.n = getattr(self, "n", 0) + 1
            loss = super().forward(batch)["loss"]
            return loss * math.inf if self.n >= 2 else loss

    with pytest.raises(FloatingPointError) as info:
        _fit(Explodes(), toy.make_classification(128), max_steps=10, log_interval=10)
    text = "".join(traceback.format_exception_only(info.value))
    assert re.findall(r"step (\d+)", text) == ["2"], text


# ---- Hugging Face: transformers models and datasets.Dataset ----

def _hf():
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    datasets = pytest.importorskip("datasets", reason="the hf extra (datasets) is not installed")
    return transformers, datasets


def _tiny_gpt2(transformers):
    config = transformers.GPT2Config(vocab_size=12, n_positions=8, n_embd=8, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _token_rows(n=24, t=6):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 12, (n, t), generator=g)


def test_a_transformers_causal_lm_trains_from_a_datasets_dataset():
    transformers, datasets = _hf()
    ids = _token_rows()
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    ds_torch = ds.with_format("torch")
    model = _tiny_gpt2(transformers)
    _, record = _fit(model, ds_torch, ds_torch, batch_size=4, max_steps=3, val_size=8)
    expected = _tiny_gpt2(transformers)(input_ids=ids[:4], labels=ids[:4]).loss  # the first batch, unshuffled
    assert math.isclose(record.train[0]["loss"], expected.item(), rel_tol=1e-5)
    assert record.val[0]["global_loss"] > 0 and record.train[-1]["tokens"] == 3 * 4 * 6
    # Plain rows of lists (no set_format) give the very same run.
    _, plain = _fit(_tiny_gpt2(transformers), ds, ds, batch_size=4, max_steps=3, val_size=8)
    assert plain.node_loss == record.node_loss and plain.val == record.val


def test_a_datasets_dataset_is_sharded_like_any_dataset():
    _, datasets = _hf()
    ids = _token_rows(n=20)
    hf = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": (ids + 1).tolist()})
    plain = TensorDataset(ids, ids + 1)
    for fmt in (hf, hf.with_format("torch")):
        for rank in range(2):
            got = NodeBatches(fmt, rank=rank, num_nodes=2, batch_size=3, shuffle=True, seed=4, shard=True)
            ref = NodeBatches(plain, rank=rank, num_nodes=2, batch_size=3, shuffle=True, seed=4, shard=True)
            for _, a, b in zip(range(5), got, ref):  # 5 steps: over an epoch boundary (3 steps per epoch)
                assert torch.equal(a["input_ids"], b[0]) and torch.equal(a["labels"], b[1])
