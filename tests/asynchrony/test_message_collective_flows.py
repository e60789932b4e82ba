"""A strategy that sends messages has its timed collectives run as flows on the shared links, in every process count:
over processes a collective's transfer goes to the keeper (the process holding node 0, whose flows the messages are),
which runs it in time order with the messages and tells every process holding a member when it ends. Hand-computed
times, and one process's bits over two and three."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.comm import isend, recv
from exogym.comm.collectives import all_reduce, new_group
from exogym.comm.transport import ReduceOp
from exogym.runs.checkpoint_checks import CheckpointError
from exogym.strategy import GossipStrategy, Strategy
import test_collective_flows  # noqa: E402
from test_messages_processes import _same  # noqa: E402

FIT = dict(progress=False, device="cpu", logger=False, batch_size=4, val_interval=100)


class MessageThenCollective(test_collective_flows.MessageThenCollective):
    """test_collective_flows' message then collective (node 0's 100 B message to node 1 from 0.5 s, a 100 B all-reduce
    of both from 1 s), declared: over processes the run has a keeper."""

    sends_messages = True


def _message_then_collective(processes: int = 1, shared_links: bool = True):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(MessageThenCollective(), 2, max_steps=2, device_flops=[2 * test_collective_flows._step_flops()] * 2,
          processes=processes, network=Network(bandwidth="800bps", latency=0.0, shared_links=shared_links), **FIT)
    return t.record


# 100 B/s ports, no latency; half a second of compute a step. The message 0 -> 1 (100 B) starts at 0.5 s on port 0 up
# and port 1 down; at 1 s the ring all-reduce of 100 B (100 B on each of the four ports) starts with the message half
# sent: both at 50 B/s (port 0 up and port 1 down each carry two flows, a flow has one rate), the message's last byte at
# 2 s, then the collective alone with 50 B left until 2.5 s. Costed alone, it would end at 1 + 1 = 2 s.
HAND_LINKS = {"port 0 up": {"busy_s": 2.0, "bytes": 200}, "port 1 down": {"busy_s": 2.0, "bytes": 200},
              "port 0 down": {"busy_s": 1.5, "bytes": 100}, "port 1 up": {"busy_s": 1.5, "bytes": 100}}


def _links_as_hand(links):
    assert sorted(links) == sorted(HAND_LINKS)
    for name, use in HAND_LINKS.items():
        assert links[name] == {"busy_s": pytest.approx(use["busy_s"], abs=1e-12), "bytes": use["bytes"]}, name


def test_a_message_strategys_collective_shares_the_link_with_its_message():
    test_collective_flows.REGISTRY.clear()
    record = _message_then_collective()
    assert test_collective_flows.REGISTRY["arrived"] == pytest.approx(2.0, abs=1e-12)
    assert [time["total_s"] for time in record.time_per_node] == [pytest.approx(2.5, abs=1e-12)] * 2
    _links_as_hand(record.links)
    alone = _message_then_collective(shared_links=False)  # each transfer by its formula: the collective ends at 2 s
    assert [time["total_s"] for time in alone.time_per_node] == [pytest.approx(2.0, abs=1e-12)] * 2


@pytest.mark.spawns
def test_over_two_processes_the_keeper_runs_the_collective_beside_the_message():
    # nodes 0 and 1 in two processes: the all-reduce crosses, its transfer is the keeper's flow
    record = _message_then_collective(processes=2)
    assert record.config["processes"] == 2
    assert [time["total_s"] for time in record.time_per_node] == [pytest.approx(2.5, abs=1e-12)] * 2
    _links_as_hand(record.links)


class PairsAndRing(Strategy):
    """Four nodes: every step each sends its parameters to the next node on a ring (isend) and takes the previous one's;
    every second step each pair ({0, 1}, {2, 3}) all-reduces as much, async, waited on after the ring's message, and in
    the steps between all four all-reduce two fragments of it, async, started at once (their flows tie); every third
    step all four all-reduce (a max: a sum across processes is exact only to rounding). Over two processes the pairs
    are each one process's (the keeper's, and the other's), the world crosses; over three, pair {2, 3} crosses
    processes without the keeper."""

    sends_messages = True

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.05)
        self.pairs = [new_group([0, 1]), new_group([2, 3])]

    @torch.no_grad()
    def step(self):
        self.optim.step()
        flat = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        if self.local_step % 2 == 0:
            works = [all_reduce(flat.clone(), group=self.pairs[self.rank // 2], async_op=True)]
        else:
            works = [all_reduce(flat.clone(), op=ReduceOp.MAX, async_op=True) for _ in range(2)]
        sending = isend(flat, (self.rank + 1) % self.num_nodes)
        got = recv(src=(self.rank - 1) % self.num_nodes).tensor
        sending.wait()
        for work in works:
            work.wait()
        if self.local_step % 3 == 2:  # the largest of every node's mix with its ring neighbour (exact in any order)
            mixed = (flat + got) / 2
            all_reduce(mixed, op=ReduceOp.MAX)
            for p, v in zip(self.model.parameters(), torch.split(mixed, [p.numel() for p in self.model.parameters()])):
                p.copy_(v.view_as(p))
        super().step()


def _pairs_and_ring(processes: int, shared_links: bool = True):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    model = t.fit(PairsAndRing(), 4, max_steps=6, processes=processes, node_speeds=[1.0, 0.7, 0.45, 0.9],
                  network=Network(bandwidth="1Mbps", latency="2ms", shared_links=shared_links), **FIT)
    return _outcome(t, model)


def _outcome(t, model):
    """What one process's bits are compared on: the model, the rows, bytes, times, the links' use and the timeline."""
    r = t.record
    return {"params": [p.detach().clone() for p in model.parameters()], "updates": r.updates, "loss": r.node_loss,
            "bytes": r.bytes_per_node, "received": [c.get("bytes_received") for c in r.comm_per_node],
            "times": r.sim_time_per_node, "val": r.val, "links": r.links, "timeline": r.timeline}


def _same_with_links(a, b):
    _same(a, b)
    assert a["links"] == b["links"] and a["timeline"] == b["timeline"]


def test_pairs_and_ring_collectives_overlap_the_messages_in_one_process():
    # the case below is a real test of the flows: sharing moves the clocks from what each transfer alone gives
    shared, alone = _pairs_and_ring(1), _pairs_and_ring(1, shared_links=False)
    assert shared["times"] != alone["times"]
    assert all(shared["links"][f"port {i} up"]["bytes"] > 0 for i in range(4))


@pytest.mark.spawns
def test_collectives_of_a_message_strategy_over_two_and_three_processes_give_one_process_bits():
    one = _pairs_and_ring(1)
    for processes in (2, 3):
        _same_with_links(one, _pairs_and_ring(processes))


def _gossip_with_failures(processes: int):
    # sync gossip on a ring, node 4 down for steps 2-3: at step 4 the nodes up hand it the model over (a mean of the
    # survivors and a broadcast: collectives) while the ring's messages of the round before may still be on the wire
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    model = t.fit(GossipStrategy(topology="ring", mode="sync", lr=0.05), 5, max_steps=6, processes=processes,
                  failures=[(4, 2, 4)], node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5],
                  network=Network(bandwidth="1Mbps", latency="2ms"), **FIT)
    return _outcome(t, model)


@pytest.mark.spawns
def test_sync_gossip_under_failures_over_two_and_three_processes_gives_one_process_numbers():
    one = _gossip_with_failures(1)
    # node 4's port carries the hand-over's broadcast as a flow, beside the messages it received (costed alone, the
    # broadcast put nothing on the links' record)
    assert one["links"]["port 4 down"]["bytes"] > one["received"][4]
    _same_with_links(one, _gossip_with_failures(2))
    # over three processes (blocks 2, 2, 1) the hand-over's mean is summed per process, then across: the models agree
    # to rounding only (docs/processes.md); the clocks, bytes and links are one process's exactly
    three = _gossip_with_failures(3)
    for key in ("times", "bytes", "received", "links", "timeline"):
        assert three[key] == one[key], key


class AsyncAcrossCheckpoint(Strategy):
    """Every node starts an async all-reduce at each step and waits on it only at the next step: at a checkpoint a
    transfer is on the wire."""

    sends_messages = True

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        self.work = None

    def step(self):
        if self.work is not None:
            self.work.wait()
        super().step()
        isend(torch.zeros(4), (self.rank + 1) % self.num_nodes)
        recv()
        self.work = all_reduce(torch.zeros(1000), async_op=True)

    def finish(self):
        if self.work is not None:
            self.work.wait()
        super().finish()


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.spawns)])
def test_a_checkpoint_with_a_collectives_transfer_on_the_wire_is_refused_before_it_is_written(processes, tmp_path):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    with pytest.raises(CheckpointError, match="node [01] reached a checkpoint at step 2 with 1 async collective"):
        t.fit(AsyncAcrossCheckpoint(), 2, max_steps=4, checkpoint_interval=2, checkpoint_dir=tmp_path / "c",
              network=Network(bandwidth="1Mbps", latency="2ms"), processes=processes, **FIT)
    assert not list((tmp_path / "c").glob("step_*"))


def test_a_message_strategy_with_collective_flows_resumes_exactly(tmp_path):
    # sync gossip under failures (collectives as flows beside the messages) checkpointed at step 4 and resumed
    def fit(folder, **kw):
        t = Trainer(toy.TinyMLP(), toy.make_classification(256))
        model = t.fit(GossipStrategy(topology="ring", mode="sync", lr=0.05), 5, max_steps=6, failures=[(4, 2, 4)],
                      node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5], network=Network(bandwidth="1Mbps", latency="2ms"),
                      checkpoint_interval=4, checkpoint_dir=folder, **FIT, **kw)
        return t.record, model

    whole, whole_model = fit(tmp_path / "a")
    resumed, resumed_model = fit(tmp_path / "b", resume_from=tmp_path / "a" / "step_000000004")
    assert all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    assert resumed.time_per_node == whole.time_per_node and resumed.links == whole.links
    assert resumed.timeline["lanes"] == whole.timeline["lanes"]


@pytest.mark.spawns
def test_a_checkpoint_before_any_message_keeps_the_collectives_links_use_over_two_processes(tmp_path):
    # gossip every third step; node 4 is down at step 1 and handed the model over at step 2 (collectives as flows),
    # checkpointed after step 2, before any message: the links' use is taken at a cut (node 0, with the keeper), and
    # the run resumed over two processes is the uninterrupted one of one process
    def fit(folder, processes, **kw):
        t = Trainer(toy.TinyMLP(), toy.make_classification(256))
        model = t.fit(GossipStrategy(topology="ring", mode="sync", H=3, lr=0.05), 5, max_steps=6,
                      failures=[(4, 1, 2)], node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5], processes=processes,
                      network=Network(bandwidth="1Mbps", latency="2ms"), checkpoint_interval=2,
                      checkpoint_dir=folder, **FIT, **kw)
        return _outcome(t, model)

    one = fit(tmp_path / "one", 1)
    assert one["links"]["port 4 down"]["bytes"] > one["received"][4]
    fit(tmp_path / "two", 2)
    saved = torch.load(tmp_path / "two" / "step_000000002" / "node0.pt", weights_only=True)["strategy"]["messages"]
    assert not saved["active"] and saved["flows"]["links"]["port 4 down"]["bytes"] > 0
    resumed = fit(tmp_path / "resumed", 2, resume_from=tmp_path / "two" / "step_000000002")
    _same_with_links(one, resumed)
