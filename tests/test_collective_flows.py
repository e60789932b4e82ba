"""Collectives as flows on the shared links (exogym.cluster.flows through the sim's event queue): a collective alone
takes its formula's time to the bit; collectives that overlap share the links their algorithm occupies, and one that
overlaps a message shares with it. Every time below is worked out by hand."""

import pytest
import torch
import toy

from exogym import Trainer
from exogym.cluster.network import Network
from exogym.comm.collectives import all_reduce
from exogym.strategy import Strategy

W = 1000.0  # bytes/s of every port: Network(bandwidth="8000bps")


class Overlapping(Strategy):
    """Each node starts an async all-reduce of `nbytes` after each of the first `starts` steps and waits for them all
    after the last step (a streaming method's fragments in miniature)."""

    def __init__(self, nbytes: int, starts: int = 2):
        super().__init__()
        self.nbytes, self.starts, self.works = nbytes, starts, []

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(self):
        super().step()
        if self.local_step <= self.starts:
            self.works.append(all_reduce(torch.zeros(self.nbytes // 4), async_op=True))
        if self.local_step == self.starts:
            for work in self.works:
                work.wait()


FIT = dict(progress=False, device="cpu", logger=False, batch_size=4, val_interval=100)


def _step_flops() -> float:
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Overlapping(4, starts=0), 1, max_steps=1, device_flops=[1.0], network="ideal", **FIT)
    return t.record.time_per_node[0]["compute_s"]


def _run(nbytes: int, network: Network, steps: int = 2):
    """Two nodes, one simulated second of compute a step, an async all-reduce after each of the steps."""
    flops = _step_flops()
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Overlapping(nbytes, starts=steps), 2, max_steps=steps, device_flops=[flops] * 2, network=network, **FIT)
    return t.record


def test_two_overlapping_all_reduces_share_the_ports():
    # ring all-reduce of N on 2 nodes puts N on each port; N = 1500 B takes 1.5 s alone. The first starts at 1 s; at
    # 2 s the second starts with 500 B of the first left: both at 500 B/s, the first's last byte at 3 s, then the
    # second alone with 1000 B left until 4 s. Latency 0.01 s after each last byte.
    record = _run(1500, Network(bandwidth="8000bps", latency=0.01))
    for node in (0, 1):
        assert record.time_per_node[node]["total_s"] == pytest.approx(4.01, abs=1e-9)
    assert record.links["port 0 up"] == {"busy_s": pytest.approx(3.0, abs=1e-9), "bytes": 3000}


def test_the_same_run_costed_alone_ends_earlier():
    # shared_links=False: each by its formula, the second from 2 s to 3.51 s
    record = _run(1500, Network(bandwidth="8000bps", latency=0.01, shared_links=False))
    assert record.time_per_node[0]["total_s"] == pytest.approx(3.51, abs=1e-9)
    assert record.links is None or record.links == {}


def test_collectives_that_never_overlap_take_the_formulas_time_to_the_bit():
    # 500 B: each ends (at 1.51 s, 2.51 s) before the next starts; the times equal shared_links=False's exactly
    net = dict(bandwidth="8000bps", latency=0.01)
    shared = _run(500, Network(**net))
    alone = _run(500, Network(**net, shared_links=False))
    assert shared.time_per_node == alone.time_per_node
    assert shared.time_per_node[0]["total_s"] == pytest.approx(2.51, abs=1e-12)


class MessageThenCollective(Strategy):
    """Node 0 starts a message of 100 B to node 1 after its first step's compute; after the second step's both
    all-reduce 100 B, then node 1 takes the message. (No sends_messages declaration: in one process a strategy may send without it, and
    its collectives then share the links with its messages.)"""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(self):
        from exogym.comm import isend, recv
        if self.local_step == 0 and self.rank == 0:
            self.sending = isend(torch.zeros(25), 1)
        super().step()
        if self.local_step == 2:
            all_reduce(torch.zeros(25))
            if self.rank == 1:
                self.arrived = recv(src=0).arrives_at
                REGISTRY["arrived"] = self.arrived
            else:
                self.sending.wait()


REGISTRY: dict = {}


def test_a_collective_during_a_message():
    # 100 B/s ports, no latency; half a second of compute a step. The message 0 -> 1 (100 B) starts at 0.5 s; at 1 s
    # the ring all-reduce of 100 B (100 B on each port) starts with the message half sent: both at 50 B/s on port 0 up
    # and port 1 down, the message's last byte at 2 s, then the collective alone with 50 B left until 2.5 s.
    flops = _step_flops()
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(MessageThenCollective(), 2, max_steps=2, device_flops=[2 * flops] * 2,
          network=Network(bandwidth="800bps", latency=0.0), **FIT)
    assert REGISTRY["arrived"] == pytest.approx(2.0, abs=1e-12)
    assert [time["total_s"] for time in t.record.time_per_node] == [pytest.approx(2.5, abs=1e-12)] * 2


@pytest.mark.spawns
def test_collectives_that_would_share_a_link_over_processes_are_refused():
    # over processes a collective is costed alone: two that overlap on a port would end earlier than in one process
    from exogym.comm.transport import CollectiveError
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    with pytest.raises(CollectiveError, match="overlaps .* on 'port"):
        t.fit(Overlapping(1500), 2, max_steps=2, device_flops=[_step_flops()] * 2,
              network=Network(bandwidth="8000bps", latency=0.01), processes=2, **FIT)


@pytest.mark.spawns
def test_collectives_alone_over_processes_give_one_process_numbers():
    flops = _step_flops()
    runs = []
    for processes in (1, 2):
        t = Trainer(toy.TinyMLP(), toy.make_classification(64))
        t.fit(Overlapping(500), 2, max_steps=2, device_flops=[flops] * 2, processes=processes,
              network=Network(bandwidth="8000bps", latency=0.01), **FIT)
        runs.append(t.record.time_per_node)
    assert runs[0] == runs[1]


class Pairs(Strategy):
    """After each step every node all-reduces `nbytes` within its pair (two islands averaging at the same time)."""

    def __init__(self, nbytes: int, pairs: list[list[int]]):
        super().__init__()
        self.nbytes, self.pairs = nbytes, pairs

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(self):
        super().step()
        all_reduce(torch.zeros(self.nbytes // 4), group=next(p for p in self.pairs if self.rank in p))


def _two_pairs_over_a_wan(shared_links: bool = True, processes: int = 1):
    """Pairs {0, 2} and {1, 3} across datacenters {0, 1} and {2, 3}: 1,000 B/s each way between them, ports free."""
    flops = _step_flops()
    net = Network(bandwidth="inf", latency=0.0, datacenters=[[0, 1], [2, 3]], inter_bandwidth="8000bps",
                  inter_latency=0.01, shared_links=shared_links)
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Pairs(1000, [[0, 2], [1, 3]]), 4, max_steps=1, device_flops=[flops] * 4, network=net, processes=processes,
          **FIT)
    return t.record


def test_two_pairs_all_reducing_across_one_wan_share_it():
    # ring all-reduce of N = 1000 B on 2 nodes puts N on each link, the WAN each way included: alone 1 s. Both pairs
    # start at 1 s and cross the WAN each way, so each gets 500 B/s: last byte at 3 s, then 0.01 s latency
    record = _two_pairs_over_a_wan()
    assert [c["total_s"] for c in record.time_per_node] == pytest.approx([3.01] * 4, abs=1e-9)
    assert record.links == {"wan 0>1": {"busy_s": pytest.approx(2.0, abs=1e-9), "bytes": 2000},
                            "wan 1>0": {"busy_s": pytest.approx(2.0, abs=1e-9), "bytes": 2000}}
    alone = _two_pairs_over_a_wan(shared_links=False)  # each by its formula: 1 + 1 + 0.01 s
    assert [c["total_s"] for c in alone.time_per_node] == pytest.approx([2.01] * 4, abs=1e-9)


@pytest.mark.spawns
def test_synchronous_collectives_that_overlap_on_a_wan_over_processes_are_refused():
    # over processes each collective is costed alone: the two pairs would end at 2.01 s, not one process's 3.01 s.
    # Process 0 holds nodes 0 and 1, a member of each pair, so it sees both on the WAN
    from exogym.comm.transport import CollectiveError
    with pytest.raises(CollectiveError, match="overlaps .* on 'wan 0>1'"):
        _two_pairs_over_a_wan(processes=2)


@pytest.mark.spawns
def test_an_async_collective_over_processes_on_a_network_without_finite_links_runs():
    # "ideal": every link infinite, every route empty, every collective 0 s: nothing to share, nothing to refuse
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Overlapping(400), 2, max_steps=2, network="ideal", processes=2, **FIT)
    assert t.record.time_per_node[0]["comm_s"] == 0.0


def test_a_resumed_run_of_collectives_on_shared_links_keeps_their_links_use(tmp_path):
    # a DiLoCo run whose only flows are its collectives: the checkpoint keeps the links' use (record.links and the
    # link lanes), and the resumed run is the uninterrupted one, clocks included (no pause of the clocks)
    from exogym.strategy import DiLoCoStrategy

    def fit(folder, **kw):
        t = Trainer(toy.TinyMLP(), toy.make_classification(64))
        model = t.fit(DiLoCoStrategy(lr=0.01, H=2), 2, max_steps=6, network=Network(bandwidth="1Mbps", latency=0.01),
                      node_speeds=[1.0, 0.5], checkpoint_interval=4, checkpoint_dir=folder, **FIT, **kw)
        return t.record, model

    whole, whole_model = fit(tmp_path / "a")
    assert whole.links["port 0 up"]["bytes"] > 0
    resumed, resumed_model = fit(tmp_path / "b", resume_from=tmp_path / "a" / "step_000000004")
    assert all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    assert resumed.links == whole.links and resumed.time_per_node == whole.time_per_node
    assert resumed.timeline["lanes"] == whole.timeline["lanes"]


class Islands(Strategy):
    """Nodes 0-1 and 2-3 each all-reduce 4,000 B within their pair every step (islands that never wait for each
    other)."""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        from exogym.comm import new_group
        self.groups = [new_group([0, 1]), new_group([2, 3])]

    def step(self):
        from exogym.comm import get_rank
        super().step()
        all_reduce(torch.zeros(1000), group=self.groups[get_rank() // 2])


def test_a_checkpoint_while_another_islands_collective_is_on_the_wire_resumes_exactly(tmp_path):
    # node 0's island is ten times faster: node 0 reaches its checkpoint while the slow island's transfer is on the
    # wire. The links' use is taken at a cut (every node met, every transfer before it ended), so the resumed run
    # gives the uninterrupted one's times and links
    def fit(folder, **kw):
        t = Trainer(toy.TinyMLP(), toy.make_classification(256))
        t.fit(Islands(), 4, max_steps=6, network=Network(bandwidth="100kbps", latency=0.01),
              node_speeds=[1.0, 1.0, 0.1, 0.1], device_flops=[2e5] * 4, checkpoint_interval=2, checkpoint_dir=folder,
              **FIT, **kw)
        return t.record

    whole = fit(tmp_path / "a")
    resumed = fit(tmp_path / "b", resume_from=tmp_path / "a" / "step_000000002")
    assert whole.links["port 2 up"]["bytes"] == 6 * 4000
    assert resumed.time_per_node == whole.time_per_node and resumed.links == whole.links
    assert resumed.timeline["lanes"] == whole.timeline["lanes"]
