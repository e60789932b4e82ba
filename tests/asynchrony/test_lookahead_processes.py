"""The lookahead across processes (exogym.backends.sim.postlink): the keeper takes events while other processes' nodes
compute, whenever none of them can still cause an earlier one, and the run gives one process's bits: the model,
the update rows, the losses, bytes and simulated times, with and without shared links and node speeds. Each run
counts the events the keeper took while a node of another process could run, so a run that fell back to waiting for
the whole run to be quiescent fails here."""

import time
from pathlib import Path

import pytest

import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.comm.transport import current_transport
from exogym.strategy import AsyncDiLoCoStrategy, FedBuffStrategy, GossipStrategy
from test_messages_processes import _same  # noqa: E402


class CountsOverlap:
    """Node 0 writes to `out`, at its last step, how many events the keeper took by the lookahead while a node of another
    process could run, and how many arrivals it took ahead of their time (-1: the run has no keeper). Nodes 2 and up
    (in the other processes) sleep 2 ms a step, which moves no simulated time."""

    def __init__(self, *args, out: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.out = out

    def step(self):
        if self.rank >= 2:  # the other processes' nodes take a while in wall time: the keeper decides events meanwhile
            time.sleep(0.002)
        super().step()

    def finish(self):
        super().finish()
        if self.rank == 0:
            keeper = getattr(current_transport().baton.messages, "keeper", None)
            Path(self.out).write_text("-1" if keeper is None else f"{keeper.overlapped} {keeper.promoted}")


class AsyncDiLoCo(CountsOverlap, AsyncDiLoCoStrategy):
    pass


class FedBuff(CountsOverlap, FedBuffStrategy):
    pass


class Gossip(CountsOverlap, GossipStrategy):
    pass


SHARED = Network(bandwidth="100Mbps", latency="30ms")
ALONE = Network(bandwidth="100Mbps", latency="30ms", shared_links=False)
SPEEDS = [1.0, 0.6, 0.3, 0.8]
CASES = {  # (strategy, its options, network, node speeds, process counts beside 1)
    "async_diloco_speeds_shared": (AsyncDiLoCo, dict(H=5, outer_lr=0.7), SHARED, SPEEDS, (2, 3)),
    "async_diloco_alone": (AsyncDiLoCo, dict(H=5, outer_lr=0.7), ALONE, None, (2,)),
    "fedbuff_speeds_shared": (FedBuff, dict(H=2, buffer_size=2, lr=0.05), SHARED, SPEEDS, (2,)),
    "gossip_async_speeds_alone": (Gossip, dict(topology="ring", mode="async", lr=0.05), ALONE, SPEEDS, (2,)),
    # every link infinite: a message arrives by the formula at once in the keeper, as a flow from another process
    "async_diloco_speeds_ideal": (AsyncDiLoCo, dict(H=5, outer_lr=0.7), "ideal", SPEEDS, (2,)),
}


def _run(case, processes, out):
    make, options, network, speeds, _ = CASES[case]
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    model = t.fit(make(out=str(out), **options), 4, max_steps=12, processes=processes, progress=False, device="cpu",
                  logger=False, batch_size=8, network=network, node_speeds=speeds, val_interval=6)
    r = t.record
    waited = [c.get("process_waited_s") for c in r.comm_per_node]  # wall seconds, so out of the comparison
    if processes == 1:
        assert waited == [None] * 4
    else:  # one figure per process, the same on each of its nodes
        assert all(w is not None and w >= 0 for w in waited) and len(set(waited)) <= processes, waited
    return {"params": [p.detach().clone() for p in model.parameters()], "updates": r.updates, "loss": r.node_loss,
            "bytes": r.bytes_per_node, "received": [c.get("bytes_received") for c in r.comm_per_node],
            "times": r.sim_time_per_node, "val": r.val}


@pytest.mark.spawns
@pytest.mark.parametrize("case", sorted(CASES))
def test_processes_overlap_their_nodes_compute_and_give_one_process_bits(case, tmp_path):
    one = _run(case, 1, tmp_path / "one")
    assert (tmp_path / "one").read_text() == "-1"
    assert one["updates"] or case.startswith("gossip")
    for processes in CASES[case][4]:
        out = tmp_path / f"p{processes}"
        _same(one, _run(case, processes, out))
        overlapped, promoted = map(int, out.read_text().split())
        assert overlapped + promoted > 0, f"processes={processes}: the keeper never took an event while others computed"
