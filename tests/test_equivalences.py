"""The invariants the engine must keep: DDP == big batch, accumulation == full batch, determinism."""

import torch
from torch.testing import assert_close
from torch.utils.data import DistributedSampler

import toy
from exogym import Trainer
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu", val_interval=1000)


def ddp(optim=None, **kwargs):
    return SimpleReduceStrategy(optim or OptimSpec(torch.optim.SGD, lr=0.1), **kwargs)


def test_ddp_k_nodes_equals_one_node_with_k_times_the_batch():
    data = toy.make_classification(256)
    for optim in (OptimSpec(torch.optim.SGD, lr=0.1), OptimSpec(torch.optim.AdamW, lr=1e-2)):
        wide = Trainer(toy.TinyMLP(), data).fit(ddp(optim), 4, batch_size=8, num_epochs=2, **FIT)
        big = Trainer(toy.TinyMLP(), data).fit(ddp(optim), 1, batch_size=32, num_epochs=2, **FIT)
        assert_close(toy.params(wide), toy.params(big), rtol=1e-5, atol=1e-6)
        assert not all(torch.equal(a, b) for a, b in zip(toy.params(big), toy.params(toy.TinyMLP())))


def test_one_node_equals_a_plain_pytorch_loop():
    data = toy.make_classification(96)
    trainer = Trainer(toy.TinyMLP(), data)
    got = trainer.fit(ddp(max_norm=0.5), 1, batch_size=16, num_epochs=3, seed=7, **FIT)

    model = toy.TinyMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
    losses = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        for i in range(0, 96, 16):
            x, y = data[idx[i:i + 16]]
            opt.zero_grad()
            loss = model((x, y))["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            losses.append(loss.item())
    assert_close(toy.params(got), toy.params(model), rtol=1e-6, atol=1e-7)
    assert trainer.record.column("loss") == losses


def test_gradient_accumulation_equals_the_full_batch():
    data = toy.make_classification(128)
    full = Trainer(toy.TinyMLP(), data).fit(ddp(), 2, batch_size=16, max_steps=6, **FIT)
    acc_trainer = Trainer(toy.TinyMLP(), data)
    acc = acc_trainer.fit(ddp(), 2, batch_size=16, minibatch_size=4, max_steps=6, **FIT)
    assert_close(toy.params(acc), toy.params(full), rtol=1e-5, atol=1e-6)
    assert acc_trainer.record.config["minibatch_size"] == 4


def _run(seed, dropout=0.3, nodes=3):
    t = Trainer(toy.TinyMLP(dropout=dropout), toy.make_classification(192), toy.make_classification(64, seed=1))
    model = t.fit(ddp(), nodes, batch_size=8, max_steps=12, seed=seed, val_interval=5, progress=False, device="cpu")
    return toy.params(model), t.record


def test_same_seed_is_bit_identical_and_another_seed_differs():
    p1, r1 = _run(seed=1)
    p2, r2 = _run(seed=1)
    p3, r3 = _run(seed=2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
    assert r1.node_loss == r2.node_loss and r1.val == r2.val
    assert not all(torch.equal(a, b) for a, b in zip(p1, p3))
    assert r1.node_loss != r3.node_loss


def _local_run(tag, nodes, seed=0):
    same_data = toy.make_classification(64)
    t = Trainer(toy.TinyMLP(dropout=0.5), lambda rank, num_nodes, is_val: same_data)
    t.fit(toy.LocalOnly(tag=tag), nodes, batch_size=16, max_steps=8, shuffle=False, seed=seed, **FIT)
    return [toy.params(toy.REGISTRY[(tag, r)]) for r in range(nodes)]


def test_each_node_has_its_own_random_stream():
    # Same data, same init, no communication: only the dropout masks can make nodes differ.
    first = _local_run("rng-a", 3)
    again = _local_run("rng-b", 3)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first[r], again[r])), f"node {r} not reproducible"
    assert not all(torch.equal(a, b) for a, b in zip(first[0], first[1]))
    assert not all(torch.equal(a, b) for a, b in zip(first[1], first[2]))
    # A node's stream depends on (seed, rank) only, not on how many nodes run beside it.
    five = _local_run("rng-c", 5)
    for r in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first[r], five[r]))


def test_non_communicating_nodes_return_their_average():
    nodes = _local_run("avg", 2)
    t = Trainer(toy.TinyMLP(dropout=0.5), lambda rank, num_nodes, is_val: toy.make_classification(64))
    model = t.fit(toy.LocalOnly(tag="avg2"), 2, batch_size=16, max_steps=8, shuffle=False, seed=0, **FIT)
    expected = [(a + b) / 2 for a, b in zip(*nodes)]
    assert_close(toy.params(model), expected, rtol=0, atol=0)
