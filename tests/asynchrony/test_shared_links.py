"""Messages share the links they cross (exogym.cluster.flows through the sim's post office): uploads that overlap
take longer, a sender's communication time includes waiting for the shared link, the links' use is recorded, a
run whose transfers never overlap gives the formula's numbers to the bit, and over two processes the bits of one."""

import pytest
import torch
import toy

from exogym import Trainer
from exogym.cluster.network import Network
from exogym.comm import SERVER, Server
from exogym.strategy import Strategy
from exogym.strategy import communicate as comm

MB = 1_000_000


class _Sink(Server):
    def receive(self, message):
        self.record_update(node=message.src, staleness=0, weight=1.0)


class Upload(Strategy):
    """Every node sends `nbytes` to the server (blocking) at its first step, after that step's compute."""

    sends_messages = True

    def __init__(self, nbytes: int = MB):
        super().__init__()
        self.nbytes = nbytes

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        comm.serve(_Sink)

    def step(self):
        if self.local_step == 0:
            comm.send(torch.zeros(self.nbytes // 4), SERVER)
        super().step()


FIT = dict(progress=False, device="cpu", logger=False, batch_size=4, max_steps=1)


def _step_flops() -> float:
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Upload(4), 1, device_flops=[1.0], network="ideal", **FIT)
    return t.record.time_per_node[0]["compute_s"]


def _uploads(starts, network, processes=1):
    """Node i computes its first step for starts[i] seconds, then uploads 1 MB; the record."""
    flops = _step_flops()
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(Upload(), len(starts), device_flops=[flops] * len(starts), node_speeds=[1 / s for s in starts],
          network=network, processes=processes, **FIT)
    return t.record


def test_four_staggered_uploads_share_the_servers_link_and_the_senders_wait_for_it():
    # 1 MB at 10 Mbit/s takes 0.8 s alone; started 0.3 s apart (at 1.0 .. 1.9 s) they end at 2.9, 3.8, 4.1, 4.2 s
    net = Network(bandwidth="10Mbps", latency="20ms")
    record = _uploads([1.0, 1.3, 1.6, 1.9], net)
    arrivals = {u["node"]: u["sim_time_s"] for u in record.updates}
    for node, end in enumerate((2.9, 3.8, 4.1, 4.2)):
        assert arrivals[node] == pytest.approx(end + 0.02, abs=1e-9)
        time = record.time_per_node[node]  # the blocking send is communication, waiting for the link included
        assert time["comm_s"] == pytest.approx(end + 0.02 - (1.0 + 0.3 * node), abs=1e-9)
    assert record.links == {"server down": {"busy_s": pytest.approx(3.2, abs=1e-9), "bytes": 4 * MB + 0}}
    assert record.summary()["links"] == record.links
    # the formula per transfer (shared_links=False): each alone, 0.8 s after it started
    old = _uploads([1.0, 1.3, 1.6, 1.9], Network(bandwidth="10Mbps", latency="20ms", shared_links=False))
    assert [u["sim_time_s"] for u in old.updates] == pytest.approx([1.82, 2.12, 2.42, 2.72], abs=1e-9)
    assert old.links == {}


def test_the_servers_link_has_a_timeline_lane_of_its_busy_time():
    # 1 MB at 10 Mbit/s (1.25 MB/s) takes 0.8 s alone. Uploads at 1.0 and 1.3 s: the first sends 0.375 MB alone, then
    # both run at 0.625 MB/s, the first ends at 2.3 s, the second sends its last 0.375 MB alone and ends at 2.6 s:
    # one busy span from 1.0 to 2.6 s with two flows at most. The third, alone from 4.0 to 4.8 s, is a span of its own.
    record = _uploads([1.0, 1.3, 4.0], Network(bandwidth="10Mbps", latency="20ms"))
    lanes = [lane for lane in record.timeline["lanes"] if lane["kind"] == "link"]
    assert [lane["name"] for lane in lanes] == list(record.links) == ["server down"]
    lane = lanes[0]
    assert lane["t"] == pytest.approx([0.0, 1.0, 2.6, 4.0, 4.8], abs=1e-9)
    assert (lane["kinds"], lane["flows"]) == ("ibib", [0, 2, 0, 1])
    busy = sum(lane["t"][i + 1] - lane["t"][i] for i, k in enumerate(lane["kinds"]) if k == "b")
    assert busy == pytest.approx(record.links["server down"]["busy_s"], abs=1e-12)
    assert "link_spans" not in record.summary()["comm_per_node"][0]  # the lanes go to timeline.json only


def test_sixteen_uploads_at_once_take_fifteen_times_longer_than_the_formula_says():
    # the case scaled down a hundredfold: 1 MB over 100 Mbit/s with 5 ms latency, sixteen at once
    net = Network(bandwidth="100Mbps", latency="5ms")
    shared = _uploads([1.0] * 16, net)
    alone = _uploads([1.0] * 16, Network(bandwidth="100Mbps", latency="5ms", shared_links=False))
    assert all(u["sim_time_s"] == pytest.approx(1.085) for u in alone.updates) and len(alone.updates) == 16
    assert all(u["sim_time_s"] == pytest.approx(2.285) for u in shared.updates) and len(shared.updates) == 16


def test_transfers_that_never_overlap_give_the_formulas_numbers_to_the_bit():
    starts = [1.0, 2.37, 3.9, 5.01]  # each 1 MB upload (0.8 s) ends before the next starts
    net = dict(bandwidth="10Mbps", latency="3ms", node_upload=["9Mbps", "10Mbps", "7.7Mbps", "10Mbps"])
    shared, alone = _uploads(starts, Network(**net)), _uploads(starts, Network(**net, shared_links=False))
    assert shared.updates == alone.updates
    assert shared.sim_time_per_node == alone.sim_time_per_node


@pytest.mark.spawns
def test_overlapping_flows_over_two_processes_give_one_process_bits():
    net = Network(bandwidth="10Mbps", latency="20ms", node_download=["5Mbps", "10Mbps", "10Mbps", "2Mbps"])
    starts = [1.0, 1.3, 1.6, 1.9]
    one, two = _uploads(starts, net), _uploads(starts, net, processes=2)
    assert two.config["processes"] == 2
    assert one.updates == two.updates and one.sim_time_per_node == two.sim_time_per_node
    assert one.links == two.links and one.timeline == two.timeline  # the keeper keeps the link lanes too
