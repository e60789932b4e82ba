"""The network's links and routes, and flows sharing them max-min fairly (exogym.cluster.network, .flows): every
case computed by hand; a transfer alone takes the formula's time to the bit."""

import heapq
import itertools
import math

import pytest

from exogym.cluster.flows import FlowModel, max_min_rates
from exogym.cluster.network import SERVER, Network, Route

MB = 1_000_000


def _drive(starts):
    """Run flows to their ends in time order (the post office's discipline: one finish event, for the flow that ends
    first, stale once a flow started or ended since): `starts` is [(at, key, route)]. Returns key -> (last byte,
    arrival) and the model."""
    model, events, order, ends = FlowModel(), [], itertools.count(), {}
    pending = sorted(starts, key=lambda s: s[0])

    def schedule():
        flow = model.next_finish()
        if flow is not None:
            heapq.heappush(events, (flow.finish, next(order), flow.key, model.version))

    while pending or events:
        if pending and (not events or pending[0][0] < events[0][0]):  # an end before a start at the same time
            at, key, route = pending.pop(0)
            model.start(key, route, at)
            schedule()
            continue
        _, _, key, version = heapq.heappop(events)
        if version != model.version:
            continue  # stale: a flow started or ended since
        flow = model.finish(key)
        ends[key] = (flow.finish, flow.arrival)
        schedule()
    return ends, model


def test_four_staggered_uploads_share_the_servers_link():
    # 100 MB at 1 Gbit/s (125 MB/s) takes 0.8 s alone; started 0.3 s apart they finish at 1.9, 2.8, 3.1, 3.2 s:
    # 0-0.3 one flow (37.5 MB), 0.3-0.6 two (18.75 each), 0.6-0.9 three (12.5 each), then four at 31.25 MB/s ...
    net = Network(bandwidth="1Gbps", latency="10ms")
    ends, model = _drive([(0.3 * i, i, net.message_route(100 * MB, i, SERVER)) for i in range(4)])
    for i, t in enumerate((1.9, 2.8, 3.1, 3.2)):
        assert ends[i][0] == pytest.approx(t, abs=1e-12)
        assert ends[i][1] == pytest.approx(t + 0.01, abs=1e-12)
    assert model.links == {"server down": {"busy_s": pytest.approx(3.2), "bytes": 400 * MB}}
    assert not model.flows


def test_a_links_busy_spans_merge_back_to_back_and_count_the_flows_at_once():
    # 10 bytes at 8 B/s: flows at 0 and 5 s share the link and end at 15 and 20 s (one busy span, two flows at
    # once); one alone from 25 to 35 s after an idle gap, and one starting at 35 s, when that one ends, continues
    # its span to 45 s
    net = Network(bandwidth="8bps", latency=0.0)
    _, model = _drive([(at, i, net.message_route(10, i % 2, SERVER)) for i, at in enumerate((0.0, 5.0, 25.0, 35.0))])
    assert model.spans == {"server down": {"t": [0.0, 20.0, 25.0, 45.0], "kinds": "bib", "flows": [2, 0, 1]}}
    assert model.links["server down"]["busy_s"] == 40.0


def test_sixteen_uploads_at_once_take_sixteen_times_as_long():
    net = Network(bandwidth="10Gbps", latency="5ms")
    alone = net.message_seconds(100 * MB, 0, SERVER)
    ends, _ = _drive([(0.0, i, net.message_route(100 * MB, i, SERVER)) for i in range(16)])
    assert alone == pytest.approx(0.085)
    assert all(arrival == pytest.approx(1.285) for _, arrival in ends.values())


def test_a_flow_capped_by_its_own_access_link_beside_a_free_one():
    # server link 100 B/s; node 0 uploads at most 10 B/s, node 1 has no cap. Node 0 runs at 10 B/s throughout (its
    # own cap: exactly the formula), node 1 takes the other 90 B/s, then node 0 is alone at its cap.
    net = Network(bandwidth="800bps", latency=0.5, node_upload=["80bps", "inf"])
    ends, _ = _drive([(0.0, 0, net.message_route(100, 0, SERVER)), (0.0, 1, net.message_route(100, 1, SERVER))])
    assert ends[0][1] == 0.0 + net.message_seconds(100, 0, SERVER) == 10.5
    assert ends[1][0] == pytest.approx(100 / 90)
    assert ends[1][1] == pytest.approx(100 / 90 + 0.5)


def test_two_datacenters_pairs_share_one_wan_link():
    # 1000 B/s inside, 100 B/s between: 0->2 and 1->3 at once each get 50 B/s of the WAN; 2->0 goes the other way
    # (full duplex: its own 100 B/s)
    net = Network(bandwidth="8000bps", latency=0.001, datacenters=[[0, 1], [2, 3]], inter_bandwidth="800bps",
                  inter_latency=0.05)
    ends, model = _drive([(0.0, "a", net.message_route(100, 0, 2)), (0.0, "b", net.message_route(100, 1, 3)),
                          (0.0, "c", net.message_route(100, 2, 0))])
    assert ends["a"][1] == pytest.approx(2.05) and ends["b"][1] == pytest.approx(2.05)
    assert ends["c"][1] == 0.0 + net.message_seconds(100, 2, 0) == pytest.approx(1.05)
    assert model.links["wan 0>1"] == {"busy_s": pytest.approx(2.0), "bytes": 200}
    assert model.links["wan 1>0"] == {"busy_s": pytest.approx(1.0), "bytes": 100}


def test_a_collective_during_a_message():
    # 100 B/s ports. A 100 B message 0->1 from 0 s; at 0.5 s a ring all-reduce of N = 100 B on [0, 1] (2 (R-1)/R N
    # = 100 B on every port it uses). The message has sent 50 B; both then get 50 B/s on port 0 up and port 1 down:
    # the message ends at 1.5 s, the collective has 50 B left and ends alone at 2.0 s.
    net = Network(bandwidth="800bps", latency=0.0)
    collective = net.collective_route("all_reduce", 100, [0, 1])
    assert collective.nbytes == 100 and collective.seconds == net.duration("all_reduce", 100, [0, 1]) == 1.0
    ends, _ = _drive([(0.0, "message", net.message_route(100, 0, 1)), (0.5, "all_reduce", collective)])
    assert ends["message"][1] == pytest.approx(1.5)
    assert ends["all_reduce"][1] == pytest.approx(2.0)


def test_one_transfer_at_a_time_takes_the_formulas_time_to_the_bit():
    # awkward numbers, every route kind: alone (and one after another) each arrives at start + the formula's seconds
    net = Network(bandwidth="3.3Gbps", latency="1.7ms", datacenters=[[0, 1], [2]], inter_bandwidth="0.7Gbps",
                  inter_latency="31ms", node_bandwidth=["9Gbps", "2.9Gbps", "5Gbps"], node_upload=["1.1Gbps"] * 3,
                  node_download=["4Gbps", "0.3Gbps", "6Gbps"], server_bandwidth="2.2Gbps", server_latency="7ms",
                  server_download="1.9Gbps", server_datacenter=1)
    pairs = [(s, d) for s in (SERVER, 0, 1, 2) for d in (SERVER, 0, 1, 2) if s != d]
    starts, t = [], 0.123456789
    for i, (s, d) in enumerate(pairs):
        route = net.message_route(1_234_567 + i, s, d)
        starts.append((t, (s, d), route))
        t += route.seconds * 1.37 + 0.01  # the next starts after this one's last byte
    ends, _ = _drive(starts)
    for at, (s, d), route in starts:
        assert ends[(s, d)][1] == at + net.message_seconds(route.nbytes, s, d)
    for topology in ("ring", "tree", "ps"):
        net_t = Network(bandwidth="3.3Gbps", latency="1.7ms", topology=topology, datacenters=[[0, 1], [2, 3, 4]],
                        inter_bandwidth="0.7Gbps", inter_latency="31ms", node_bandwidth=["9Gbps"] * 4 + ["2.9Gbps"])
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"):
            for ranks in ([0, 1], [0, 2, 4], [0, 1, 2, 3, 4]):
                route = net_t.collective_route(op, 7_654_321, ranks)
                ends, _ = _drive([(0.42, "c", route)])
                assert ends["c"][1] == 0.42 + net_t.duration(op, 7_654_321, ranks), (topology, op, ranks)


def test_a_routes_bandwidth_is_the_formulas():
    # the least capacity on a route is the W of the formula: node caps, upload/download caps, the server's link, the
    # WAN; a node reaches the server over its own connection and the server's link, not over its datacenter's ports
    net = Network(bandwidth="80bps", latency=1.0, node_upload=["40bps", "80bps"], node_download=["80bps", "16bps"],
                  server_bandwidth="160bps", server_latency=0.5, server_download="40bps")
    assert net.message_route(10, 0, 1).links == ("port 0 up", "access 0 up", "port 1 down", "access 1 down")
    assert net.message_route(10, 1, SERVER).links == ("access 1 up", "server down")
    for s, d, w in ((0, 1, 2), (1, 0, 10), (0, SERVER, 5), (SERVER, 1, 2), (1, SERVER, 5)):
        route = net.message_route(10, s, d)
        assert min(route.capacities) == w and route.seconds == net.message_seconds(10, s, d)
    assert net.message_route(10, 1, 1) == Route((), (), 10, 0.0, 0.0)
    dc = Network(bandwidth="1Gbps", latency="1ms", datacenters=[[0, 1], [2, 3]], inter_bandwidth="100Mbps",
                 inter_latency="40ms")
    ring = dc.collective_route("all_reduce", 1000, [0, 1, 2, 3])
    assert {"wan 0>1", "wan 1>0"} <= set(ring.links) and min(ring.capacities) == dc.link([0, 1, 2, 3])[0]
    assert "wan 0>1" not in dc.collective_route("all_reduce", 1000, [0, 1]).links
    assert Network.preset("ideal").message_route(10, 0, SERVER).links == ()  # infinite links are left out


def test_max_min_fair_rates_by_progressive_filling():
    # link a (10 B/s) carries x and y, link b (4 B/s) carries y and z: y and z get 2 (b is the bottleneck), x the rest
    x, y, z = (Route(links, caps, 1, 0.0, 0.0) for links, caps in
               ((("a",), (10.0,)), (("a", "b"), (10.0, 4.0)), (("b",), (4.0,))))
    model = FlowModel()
    for key, route in zip("xyz", (x, y, z)):
        model.start(key, route, 0.0)
    rates = {f.key: r for f, r in max_min_rates(model.flows.values()).items()}
    assert rates == {"x": 8.0, "y": 2.0, "z": 2.0}
    assert max_min_rates([]) == {}


def test_a_start_re_rates_the_flows_it_shares_with_and_moves_the_version():
    net = Network(bandwidth="8bps", latency=0.0)
    model = FlowModel()
    first = model.start(1, net.message_route(10, 0, SERVER), 0.0)
    assert (first.finish, model.version, model.next_finish()) == (10.0, 1, first)
    # the second halves the first's rate: it ends at 15 s; the second would end at 25 s at half rate, and ends at
    # 20 s once it has the link to itself
    second = model.start(2, net.message_route(10, 1, SERVER), 5.0)
    assert (model.version, first.finish, second.finish, model.next_finish()) == (2, 15.0, 25.0, first)
    assert model.finish(1).arrival == 15.0 and second.finish == 20.0 and model.version == 3
    with pytest.raises(ValueError, match="already in flight"):
        model.start(2, net.message_route(10, 1, SERVER), 16.0)


def test_a_flow_model_resumes_from_its_state():
    net = Network(bandwidth="8bps", latency=0.25)
    a, b = FlowModel(), FlowModel()
    for m in (a,):
        m.start((0, 0), net.message_route(10, 0, SERVER), 0.0)
        m.start((1, 0), net.message_route(10, 1, SERVER), 5.0)
    b.load_state_dict(a.state_dict())
    assert [(f.finish, f.shared) for f in a.flows.values()] == [(f.finish, f.shared) for f in b.flows.values()]
    assert a.version == b.version == 2
    ends = [(a.finish((0, 0)).arrival, b.finish((0, 0)).arrival)]
    assert ends == [(15.25, 15.25)] and a.links == b.links
    ends = [(a.finish((1, 0)).arrival, b.finish((1, 0)).arrival)]  # the link's busy span, begun before the state
    assert ends == [(20.25, 20.25)] and a.spans == b.spans == {"server down": {"t": [0.0, 20.0], "kinds": "b",
                                                                               "flows": [2]}}
    a.start((0, 1), net.message_route(10, 0, SERVER), 30.0)
    c = FlowModel()
    c.load_state_dict(a.state_dict())  # a closed busy span and a link busy now
    assert a.finish((0, 1)).arrival == c.finish((0, 1)).arrival == 40.25
    assert a.spans == c.spans == {"server down": {"t": [0.0, 20.0, 30.0, 40.0], "kinds": "bib", "flows": [2, 0, 1]}}


def test_bad_network_arguments_are_named():
    with pytest.raises(TypeError, match="shared_links must be True or False"):
        Network(shared_links="yes")
    with pytest.raises(ValueError, match="server_datacenter only means something with datacenters"):
        Network(server_datacenter=0)
    with pytest.raises(ValueError, match=r"server_datacenter must be the index of one of the 2 datacenters \(0..1\)"):
        Network(datacenters=[[0], [1]], inter_bandwidth="1Gbps", inter_latency=0.1, server_datacenter=2)
    Network(datacenters=[[0], [1]], inter_bandwidth="1Gbps", inter_latency=0.1, server_datacenter=1)  # the boundary
    assert math.isinf(min(Network.preset("ideal").collective_route("all_reduce", 8, [0, 1]).capacities,
                          default=math.inf))


def test_a_collective_flow_sets_its_members_clocks_as_the_formula_when_alone_and_later_when_shared():
    from exogym.cluster.simtime import NodeClock, TimeModel
    net = Network(bandwidth="3.3Gbps", latency="1.7ms")
    model = TimeModel(net, (1.0, 1.0), (1.0, 1.0), measured=False)
    route = net.collective_route("all_reduce", 7_654_321, [0, 1])
    formula = [NodeClock(now=0.3), NodeClock(now=0.1)]
    model.leave([(formula[0], 0.3, True), (formula[1], 0.1, True)], 0.3, "all_reduce", 7_654_321, [0, 1])
    ends, _ = _drive([(0.3, "c", route)])
    flows = FlowModel()
    flows.start("c", route, 0.3)
    alone = [NodeClock(now=0.3), NodeClock(now=0.1)]
    done = model.leave_flow([(alone[0], 0.3, True), (alone[1], 0.1, True)], 0.3, flows.finish("c"))
    assert alone == formula and done == ends["c"][1] == formula[0].now
    # beside a message on port 0 up for its whole life, the collective runs at half rate: its members communicate
    # for twice the transfer time, plus the latency
    flows = FlowModel()
    flows.start("m", net.message_route(10**12, 0, 1), 0.0)
    flows.start("c", route, 0.3)
    shared = [NodeClock(now=0.3), NodeClock(now=0.1)]
    done = model.leave_flow([(shared[0], 0.3, True), (shared[1], 0.1, True)], 0.3, flows.finish("c"))
    transfer = route.nbytes / min(route.capacities)
    assert done == pytest.approx(0.3 + 2 * transfer + route.latency)
    assert shared[1].wait_s == pytest.approx(0.2) and shared[1].comm_s == pytest.approx(2 * transfer + route.latency)
