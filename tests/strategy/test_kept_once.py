"""State every node holds identically by construction is kept once in the sim, without moving a bit."""

import torch

import toy
from exogym import Trainer
from exogym.strategy import (DiLoCoStrategy, OptimSpec, SimpleReduceStrategy, SPARTADiLoCoStrategy,
                             StreamingDiLoCoStrategy)
from strategy_toys import NODES, run_linear, watched

GRADS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [0.5, 0.5, 0.5]]
INIT = [1.0, 2.0, 3.0]
SGD = OptimSpec(torch.optim.SGD, lr=0.1)


def test_one_outer_model_for_all_nodes_and_grads_freed_after_the_inner_step():
    for cls, kwargs, index in ((DiLoCoStrategy, dict(H=3), 0), (SPARTADiLoCoStrategy, dict(H=3), 1),
                               (StreamingDiLoCoStrategy, dict(H=4, num_fragments=1, tau=0), 0)):
        run_linear(watched(cls)(SGD, **kwargs), GRADS, INIT, 7)
        outers = {id(NODES[r][1].modules[index].outer) for r in range(3)}
        assert len(outers) == 1  # one theta_g and one outer optimizer, not three
        assert all(p.grad is None for r in range(3) for p in NODES[r][0].parameters())


def test_overlapping_streaming_keeps_one_per_node():
    run_linear(watched(StreamingDiLoCoStrategy)(SGD, H=4, num_fragments=1, tau=1), GRADS, INIT, 7)
    assert len({id(NODES[r][1].modules[0].outer) for r in range(3)}) == 3


class _OwnCopies(SimpleReduceStrategy):
    """DDP with its step overridden (unchanged): a subclass keeps K copies unless it says one_replica = True."""

    def step(self):
        super().step()


def test_ddp_keeps_one_replica_for_all_nodes():
    run_linear(watched(SimpleReduceStrategy)(SGD), GRADS, INIT, 3)
    assert len({id(NODES[r][1].replica) for r in range(3)}) == 1
    assert len({id(NODES[r][1].optim) for r in range(3)}) == 1  # one optimizer state, not three
    assert len({NODES[r][0].w.data_ptr() for r in range(3)}) == 1  # one parameter storage
    assert all(NODES[r][0].w.grad is None for r in range(3))  # gradients live only until they enter the mean
    run_linear(watched(_OwnCopies)(SGD), GRADS, INIT, 3)
    assert len({NODES[r][0].w.data_ptr() for r in range(3)}) == 3 and NODES[0][1].replica is None


class _SaysOneReplica(_OwnCopies):
    one_replica = True  # its author's explicit choice: the step is DDP's own


def test_one_replica_is_a_subclass_authors_explicit_choice():
    assert SimpleReduceStrategy.one_replica and not _OwnCopies.one_replica and _SaysOneReplica.one_replica
    model, _ = run_linear(watched(_SaysOneReplica)(SGD), GRADS, INIT, 3)
    assert len({NODES[r][0].w.data_ptr() for r in range(3)}) == 1 and NODES[0][1].replica is not None
    expected, _ = run_linear(_OwnCopies(SGD), GRADS, INIT, 3)
    assert torch.equal(model.w, expected.w) and not torch.equal(model.w, torch.tensor(INIT))


class _OwnOptimizer(SimpleReduceStrategy):
    """DDP whose _init_node builds its own optimizer (as a README-style subclass may), even saying one_replica."""

    one_replica = True

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_subclass_building_its_own_optimizer_steps_its_own_copies():
    model, _ = run_linear(watched(_OwnOptimizer)(SGD), GRADS, INIT, 3)
    assert len({NODES[r][0].w.data_ptr() for r in range(3)}) == 3 and NODES[0][1].replica is None
    expected, _ = run_linear(SimpleReduceStrategy(SGD), GRADS, INIT, 3)  # the same SGD, kept once
    assert torch.equal(model.w, expected.w) and not torch.equal(model.w, torch.tensor(INIT))


def _ddp_run(cls, **fit):
    # AdamW under a chainable schedule (StepLR multiplies the current rate: stepped K times it would decay K
    # times as fast), clipping, gradient accumulation, a failure and a node coming back, and validation.
    torch.manual_seed(0)
    trainer = Trainer(toy.TinyMLP(dropout=0.1), toy.make_classification(512), toy.make_classification(64, seed=1))
    strategy = cls(OptimSpec(torch.optim.AdamW, lr=3e-2), max_norm=0.5, lr_scheduler=torch.optim.lr_scheduler.StepLR,
                   lr_scheduler_kwargs={"step_size": 3, "gamma": 0.5})
    model = trainer.fit(strategy, 4, batch_size=16, minibatch_size=8, max_steps=12, val_interval=4, seed=3,
                        failures=[(2, 4, 7)], progress=False, logger=False, **fit)
    return model, trainer.record


def test_one_replica_moves_no_bit():
    """The replica run against the same strategy keeping K copies (a subclass with the same arithmetic)."""
    once, copies = _ddp_run(SimpleReduceStrategy), _ddp_run(_OwnCopies)
    for a, b in zip(once[0].state_dict().values(), copies[0].state_dict().values()):
        assert torch.equal(a, b)
    timeless = [[{k: v for k, v in row.items() if k != "wall_time_s"} for row in r.train] for r in (once[1], copies[1])]
    assert timeless[0] == timeless[1]  # losses, learning rates, bytes
    assert once[1].node_loss == copies[1].node_loss and once[1].val == copies[1].val
    assert once[1].bytes_per_node == copies[1].bytes_per_node
    assert once[1].train[-1]["lr"] == 3e-2 * 0.5 ** 3  # the schedule stepped once per step, not once per node


def test_one_replica_resumes_bit_identically(tmp_path):
    toy.assert_resumes_bit_identically(lambda: SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-2),
                                                                    warmup_steps=3), _trainer, tmp_path)


def _trainer():
    return Trainer(toy.TinyMLP(), toy.make_classification(512))
