"""Checkpoints of message-passing runs: a pause in simulated time that saves what is in flight (messages, the
server's buffer, its timers); resuming from one continues exactly as the run that went on."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, DecoupledDiLoCoStrategy, FedBuffStrategy, GossipStrategy

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8, node_speeds=[1.0, 0.6, 0.3],
           network="home", val_interval=5)

STRATEGIES = {
    "async_diloco": lambda: AsyncDiLoCoStrategy(H=3, lr=1e-2, staleness="polynomial", delayed_nesterov=True,
                                                dynamic_local_updates=True),
    "async_diloco_framework": lambda: AsyncDiLoCoStrategy(  # a grace window open at the pause
        H=2, lr=1e-2, delayed_nesterov=True, momentum_activation=0.2, grace_s=0.3, dynamic_local_updates="speeds",
        inner_state="reset"),
    "fedbuff": lambda: FedBuffStrategy(H=2, buffer_size=2, lr=0.05),
    "decoupled": lambda: DecoupledDiLoCoStrategy(H=4, fragments=2, min_quorum=2, lr=1e-2),
    "gossip_async": lambda: GossipStrategy(topology="ring", mode="async", lr=0.05),
    "gossip_sync": lambda: GossipStrategy(topology="random_pairs", H=2, lr=0.05),
}


def _trainer():
    return Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))


SHARD_SAMPLING = {  # one process only (a node reads other nodes' shards): not in STRATEGIES, which run over several
    "async_diloco_shards": lambda: AsyncDiLoCoStrategy(
        H=2, lr=1e-2, grace_s=0.3, shard_sampling="undersampled", shard_seed=1, inner_state="reset",
        lr_scheduler="lambda_cosine", cosine_anneal=True),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES) + sorted(SHARD_SAMPLING))
def test_resuming_gives_the_run_that_went_on(name, tmp_path):
    make = {**STRATEGIES, **SHARD_SAMPLING}[name]
    full_t = _trainer()
    full = full_t.fit(make(), 3, max_steps=10, checkpoint_interval=5, checkpoint_dir=tmp_path / "a", **FIT)
    resumed_t = _trainer()
    # the same run, resumed (a checkpoint pauses the clocks: the resumed run keeps checkpointing as the other did)
    resumed = resumed_t.fit(make(), 3, max_steps=10, checkpoint_interval=5, checkpoint_dir=tmp_path / "b",
                            resume_from=tmp_path / "a" / "step_000000005", **FIT)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))
    assert resumed_t.record.node_loss == full_t.record.node_loss
    assert resumed_t.record.updates == full_t.record.updates
    assert resumed_t.record.sim_time_per_node == full_t.record.sim_time_per_node
    assert resumed_t.record.bytes_per_node == full_t.record.bytes_per_node
