"""Simulated time: the network formulas, virtual clocks at collectives, stragglers, units and errors."""

import math

import pytest
import torch

import toy
from exogym import Trainer
from exogym.cluster.network import Network, parse_bandwidth, parse_seconds
from exogym.strategy import OptimSpec, SimpleReduceStrategy

FIT = dict(progress=False, device="cpu", logger=False)
MB = 10**6


def test_collective_durations_on_hand_computed_cases():
    net = Network(bandwidth="1Gbps", latency="20ms")  # W = 1.25e8 bytes/s
    four = range(4)
    assert math.isclose(net.duration("all_reduce", MB, four), 2 * MB * 3 / 4 / 1.25e8 + 0.02)
    assert math.isclose(net.duration("reduce_scatter", MB, four), MB * 3 / 4 / 1.25e8 + 0.02)
    assert math.isclose(net.duration("all_gather", MB, four), MB * 3 / 4 / 1.25e8 + 0.02)
    assert math.isclose(net.duration("broadcast", MB, four), MB / 1.25e8 + 0.02)
    assert net.duration("barrier", 0, four) == 0.02 and net.duration("all_reduce", MB, [3]) == 0.0
    tree = Network(bandwidth="1Gbps", latency="20ms", topology="tree")
    assert math.isclose(tree.duration("all_reduce", MB, range(8)), 2 * 3 * (MB / 1.25e8 + 0.02))
    ps = Network(bandwidth="1Gbps", latency="20ms", topology="ps")
    assert math.isclose(ps.duration("all_reduce", MB, four), 2 * 3 * MB / 1.25e8 + 0.04)
    assert Network.preset("ideal").duration("all_reduce", 10**9, range(8)) == 0.0


def test_datacenters_and_slow_uplinks_set_the_groups_link():
    net = Network(bandwidth="100Gbps", latency="0.1ms", datacenters=[[0, 1], [2, 3]],
                  inter_bandwidth="1Gbps", inter_latency="30ms", node_bandwidth=["100Gbps"] * 3 + ["10Gbps"])
    assert net.link([0, 1]) == (100e9 / 8, 1e-4)           # inside one datacenter
    assert net.link([1, 2]) == (1e9 / 8, 0.03)             # across: the slow link
    assert net.link([2, 3]) == (10e9 / 8, 1e-4)            # node 3's uplink caps its group
    with pytest.raises(ValueError, match="partition the ranks"):
        Network(datacenters=[[0, 1], [1, 2]], inter_bandwidth=1e9, inter_latency=0.01)
    with pytest.raises(ValueError, match="needs inter_bandwidth and inter_latency"):
        Network(datacenters=[[0], [1]])


def test_units_parse_and_bad_values_are_clear():
    assert parse_bandwidth("1Gbps") == parse_bandwidth(1e9) == parse_bandwidth("1 Gbit/s") == 1.25e8
    assert parse_bandwidth("100MB/s") == 1e8 and parse_bandwidth("inf") == math.inf
    assert parse_seconds("20ms") == parse_seconds(0.02) and math.isclose(parse_seconds("100us"), 1e-4)
    with pytest.raises(ValueError, match="'fast' is not a bandwidth; write e.g. '1Gbps'"):
        Network(bandwidth="fast")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Network(bandwidth=0)
    with pytest.raises(ValueError, match="'20 minutes' is not a duration"):
        Network(latency="20 minutes")
    with pytest.raises(ValueError, match="topology must be one of"):
        Network(topology="mesh")
    with pytest.raises(ValueError, match="unknown network preset 'wan'"):
        Network.preset("wan")


def _ddp_run(**time_kwargs):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    t.fit(SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1)), 4, batch_size=8, max_steps=5, **FIT,
          **time_kwargs)
    return t.record


def test_clocks_add_compute_and_the_networks_time_for_each_collective():
    record = _ddp_run(network=Network(bandwidth="1Gbps", latency="5ms"), device_flops=1e9)
    grad_bytes = sum(p.numel() * 4 for p in toy.TinyMLP().parameters())
    comm_per_step = 2 * grad_bytes * 3 / 4 / 1.25e8 + 0.005
    per_node = record.sim_time_per_node
    compute_per_step = per_node[0]["compute_s"] / 5
    assert compute_per_step > 0
    for clock in per_node:
        assert math.isclose(clock["comm_s"], 5 * comm_per_step, rel_tol=1e-9)
        assert clock["wait_s"] == 0.0  # equal nodes arrive together
        assert math.isclose(clock["now"], clock["compute_s"] + clock["comm_s"] + clock["wait_s"])
    assert [round(t, 12) for t in record.column("sim_time_s")] == \
        [round(s * (compute_per_step + comm_per_step), 12) for s in range(1, 6)]
    assert record.sim_time_s == max(c["now"] for c in per_node)


def test_halving_bandwidth_doubles_ddp_communication_time():
    fast = _ddp_run(network=Network(bandwidth="2Gbps", latency=0))
    slow = _ddp_run(network=Network(bandwidth="1Gbps", latency=0))
    assert math.isclose(slow.sim_time_per_node[0]["comm_s"], 2 * fast.sim_time_per_node[0]["comm_s"])
    ideal = _ddp_run(network="ideal")
    assert ideal.sim_time_per_node[0]["comm_s"] == 0.0


def test_a_straggler_makes_the_others_wait_the_difference_every_step():
    record = _ddp_run(network="ideal", node_speeds=[1, 1, 1, 0.5], device_flops=1e9)
    clocks = record.sim_time_per_node
    fast_compute = clocks[0]["compute_s"]
    assert math.isclose(clocks[3]["compute_s"], 2 * fast_compute)
    for r in range(3):
        assert math.isclose(clocks[r]["wait_s"], clocks[3]["compute_s"] - clocks[r]["compute_s"])
    assert clocks[3]["wait_s"] == 0.0
    assert len({round(c["now"], 12) for c in clocks}) == 1  # they leave every collective together


def test_measured_compute_time_and_time_model_validation():
    record = _ddp_run(compute_time="measured")
    assert all(c["compute_s"] > 0 for c in record.sim_time_per_node)
    assert "sim_time_s" not in _ddp_run().train[0]  # no time model unless asked for
    with pytest.raises(ValueError, match=r"node_speeds needs one value per node \(num_nodes=4\), got 2"):
        _ddp_run(node_speeds=[1, 2])
    with pytest.raises(ValueError, match=r"node_speeds\[1\] must be > 0"):
        _ddp_run(node_speeds=[1, 0, 1, 1])
    with pytest.raises(ValueError, match="compute_time must be 'flops' or 'measured'"):
        _ddp_run(compute_time="wall")
    with pytest.raises(TypeError, match="network must be an exogym.cluster.network.Network"):
        _ddp_run(network=1e9)
    with pytest.raises(ValueError, match="datacenters cover 2 ranks but the run has num_nodes=4"):
        _ddp_run(network=Network(datacenters=[[0], [1]], inter_bandwidth=1e9, inter_latency=0.1))


def test_diloco_on_a_slow_network_takes_a_fraction_of_ddps_simulated_time():
    from exogym.strategy import DiLoCoStrategy

    net = Network(bandwidth="100Mbps", latency="10ms")
    kw = dict(network=net, device_flops=1e9, **FIT)
    ddp_t, diloco_t = (Trainer(toy.TinyMLP(), toy.make_classification(512)) for _ in range(2))
    ddp_t.fit(SimpleReduceStrategy("sgd", lr=0.1), 4, batch_size=8, max_steps=100, **kw)
    diloco_t.fit(DiLoCoStrategy("sgd", lr=0.1, H=50), 4, batch_size=8, max_steps=100, **kw)
    model_bytes = sum(p.numel() * 4 for p in toy.TinyMLP().parameters())
    one_sync = 2 * model_bytes * 3 / 4 / (100e6 / 8) + 0.01
    ddp, diloco = ddp_t.record.sim_time_per_node[0], diloco_t.record.sim_time_per_node[0]
    assert math.isclose(ddp["comm_s"], 100 * one_sync) and math.isclose(diloco["comm_s"], 2 * one_sync)
    assert math.isclose(ddp["compute_s"], diloco["compute_s"])  # the same arithmetic per step
    assert diloco_t.record.sim_time_s < 0.1 * ddp_t.record.sim_time_s
