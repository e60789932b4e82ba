"""Point-to-point messages and the server on the simulated clock: arrival times, arrival order, errors."""

import math

import pytest
import torch

import toy
from toy import TinyMLP, make_classification
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.comm import SERVER, MessageError, Server
from exogym.strategy import AsyncDiLoCoStrategy, FedBuffStrategy, GossipStrategy, Strategy
from exogym.strategy import communicate as comm

FIT = dict(progress=False, device="cpu", logger=False)
LOG: dict = {}


class Recorder(Server):
    """Keeps (arrival time, sender, first value) of every message, in the order handled."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def receive(self, m):
        self.seen.append((m.arrives_at, m.src, float(m.tensor[0])))
        if m.tag == 1:
            self.send(m.src, m.tensor * 10, tag=2)
        if m.tag == 9:
            raise ValueError("boom")


class Talks(Strategy):
    """Each step: node r sends [r, step] to the server; the tag decides whether it waits for a reply."""

    def __init__(self, tag=0, **kw):
        super().__init__(**kw)
        self.tag = tag

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        self.server = comm.serve(Recorder)

    def step(self):
        comm.send(torch.tensor([float(self.rank), float(self.local_step)]), SERVER, tag=self.tag)
        if self.tag == 1:
            m = comm.recv(src=SERVER, tag=2)
            LOG[(self.rank, self.local_step)] = (m.arrives_at, comm.now())
        if self.rank == 0 and self.local_step + 1 == self.max_steps:
            LOG["seen"] = comm.read_server(lambda s: list(s.seen))
        super().step()


def _fit(strategy, nodes=3, steps=3, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(strategy, nodes, batch_size=4, max_steps=steps, **FIT, **kw)
    return t


def test_messages_arrive_at_the_senders_clock_plus_the_transfer_time_in_that_order():
    # latency 1 s, infinite bandwidth; speeds make node r's step take 1/speed_r s of compute.
    net = Network(bandwidth="inf", latency=1.0)
    t = _fit(Talks(), node_speeds=[1.0, 0.5, 0.25], device_flops=None, network=net)
    c = t.record.sim_time_per_node[0]["compute_s"] / 3  # node 0's compute per step
    LOG.clear()
    t = _fit(Talks(), node_speeds=[1.0, 0.5, 0.25], network=net)
    seen = LOG["seen"]
    # node r's k-th message (k from 1) leaves at k*(c/speed + 1) - 1 (a blocking send costs the 1 s transfer)
    # and arrives 1 s later; node 0 reads the server at its last step's clock (3c + 2) + 1 s of its last send.
    expect = sorted(((k * (c / s + 1.0), r, float(r)) for r, s in enumerate([1.0, 0.5, 0.25]) for k in (1, 2, 3)))
    read_at = 3 * (c + 1.0)
    assert [(a, r) for a, r, _ in seen] == [(a, r) for a, r, _ in expect if a <= read_at + 1e-12]
    for (a, _, _), (b, _, _) in zip(seen, expect):
        assert math.isclose(a, b)


def test_a_reply_arrives_after_the_round_trip():
    net = Network(bandwidth="inf", latency=0.5)
    LOG.clear()
    t = _fit(Talks(tag=1), nodes=2, network=net)
    c = t.record.sim_time_per_node[0]["compute_s"] / 3
    arrives, now = LOG[(0, 0)]
    assert math.isclose(arrives, c + 1.0) and math.isclose(now, c + 1.0)
    assert t.record.comm_per_node[0]["bytes_received"] == 3 * 8  # three float32[2] replies


def test_same_run_same_bits_and_arrival_order_ties_go_by_rank():
    LOG.clear()
    _fit(Talks())  # no time model: every clock stands at 0, every message arrives at 0
    first = LOG["seen"]
    assert [r for _, r, _ in first] == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # ties: by sender, then in the order sent
    LOG.clear()
    _fit(Talks(), execution="fused")
    assert LOG["seen"] == first


def test_a_recv_no_send_will_match_is_an_error_naming_the_nodes():
    class Waits(Strategy):
        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

        def step(self):
            if self.rank == 1:
                comm.recv(src=0, tag=7)
            super().step()

    with pytest.raises(MessageError, match="deadlock") as info:
        _fit(Waits(), nodes=2, steps=1)
    assert "node 1: waits in recv from node 0 with tag 7 at step 1" in str(info.value)


def test_a_server_that_raises_is_an_error_naming_the_message():
    with pytest.raises(MessageError, match=r"raised while handling message #0 from node 0 to the server \(tag 9"):
        _fit(Talks(tag=9), nodes=2, steps=1)


def test_per_direction_caps_and_the_servers_link():
    # bytes/s: a node's upload, the receiver's download and the link's bandwidth; the slowest sets the pace
    net = Network(bandwidth="80bps", latency=1.0, node_upload=["40bps", "80bps"], node_download=["80bps", "16bps"],
                  server_bandwidth="160bps", server_latency=0.5, server_download="40bps")
    assert net.message_seconds(10, 0, 1) == 1.0 + 10 / 2  # node 1's download: 2 B/s
    assert net.message_seconds(10, 1, 0) == 1.0 + 10 / 10  # the link: 10 B/s
    assert net.message_seconds(10, 0, SERVER) == 0.5 + 10 / 5  # node 0's upload and the server's download: 5 B/s
    assert net.message_seconds(10, SERVER, 1) == 0.5 + 10 / 2  # node 1's download
    assert net.message_seconds(10, 1, SERVER) == 0.5 + 10 / 5  # the server's download
    with pytest.raises(ValueError, match="node_upload has 2 entries but the run has num_nodes=3"):
        net.check_nodes(3)
    net.check_nodes(2)


def test_under_fused_execution_the_event_order_is_the_same_and_the_numbers_agree_to_rounding():
    # fused execution batches the forward/backward (float rounding differs, as for every strategy); the order of
    # events is the clock's, so updates, staleness, times and bytes are identical
    from exogym.strategy import DecoupledDiLoCoStrategy, GossipStrategy
    for make in (lambda: GossipStrategy(topology="ring", mode="async", lr=0.05),
                 lambda: DecoupledDiLoCoStrategy(H=2, min_quorum=2, lr=1e-2)):
        runs = []
        for execution in ("sequential", "fused"):
            t = Trainer(toy.TinyMLP(), toy.make_classification(128))
            model = t.fit(make(), 3, batch_size=8, max_steps=6, node_speeds=[1.0, 0.5, 0.3], network="home",
                          execution=execution, **FIT)
            runs.append((t.record, [p.detach().clone() for p in model.parameters()]))
        (a, pa), (b, pb) = runs
        assert [{k: v for k, v in u.items() if k != "weight"} for u in a.updates] == \
            [{k: v for k, v in u.items() if k != "weight"} for u in b.updates]
        assert a.sim_time_per_node == b.sim_time_per_node and a.bytes_per_node == b.bytes_per_node
        torch.testing.assert_close(torch.tensor(a.node_loss), torch.tensor(b.node_loss), rtol=1e-5, atol=1e-6)
        for x, y in zip(pa, pb):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: AsyncDiLoCoStrategy(H=2), lambda: FedBuffStrategy(H=2),
                                  lambda: GossipStrategy(H=2)], ids=["async_diloco", "fedbuff", "gossip"])
@pytest.mark.spawns
def test_message_strategies_over_several_processes_run_as_in_one_process(make):
    # Once refused up front; now the process holding node 0 keeps the run's one event heap and the others forward to
    # it (exogym.backends.sim.postlink): the same losses and bytes (tests/asynchrony/test_messages_processes.py has
    # the bit-for-bit comparisons).
    records = []
    for processes in (1, 2):
        trainer = Trainer(TinyMLP(), make_classification(64))
        trainer.fit(make(), 2, max_steps=2, batch_size=8, processes=processes, progress=False, logger=False)
        records.append(trainer.record)
    one, two = records
    assert two.config["processes"] == 2
    assert two.node_loss == one.node_loss and two.bytes_per_node == one.bytes_per_node


class Keeps(Server):
    """Keeps every message it receives."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def receive(self, m):
        self.kept.append(m)


class SendsOnce(Strategy):
    """Node 0 sends one tensor (copied or not, as asked), then changes its own in place."""

    def __init__(self, copy, **kw):
        super().__init__(**kw)
        self.copy = copy

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        self.server = comm.serve(Keeps)

    def step(self):
        if self.rank == 0 and self.local_step == 0:
            x = torch.ones(3)
            comm.send(x, SERVER, copy=self.copy)
            x.add_(1.0)  # what the receiver reads depends on the copy
            LOG["sent"] = x
            LOG["kept"] = comm.read_server(lambda s: [m.tensor for m in s.kept])
        super().step()


@pytest.mark.parametrize("copy", [True, False])
def test_send_copies_by_default_and_copy_false_hands_the_tensor_itself(copy):
    LOG.clear()
    _fit(SendsOnce(copy), nodes=2, steps=1)
    (received,) = LOG["kept"]
    assert (received.data_ptr() == LOG["sent"].data_ptr()) == (not copy)  # the same memory, or a copy
    assert torch.equal(received, torch.full((3,), 2.0 if not copy else 1.0))


def test_send_refuses_a_copy_that_is_not_a_bool():
    with pytest.raises(TypeError, match="copy must be True or False"):
        _fit(SendsOnce(copy="no"), nodes=2, steps=1)
