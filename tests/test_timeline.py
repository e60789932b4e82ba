"""The timeline: each node's spans tile its simulated clock and add up to its clock's counts; synchronous DiLoCo's
fast nodes wait where the slowest does not; asynchronous nodes send messages that the server turns into updates;
a long run stays a few spans a round; a resumed run's timeline is the uninterrupted one's (its link lanes too, with
flows on the wire at the checkpoint); the Chrome trace export holds every span, message and update."""

import json
import math

import pytest
import torch

import toy
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.runs.loggers import CSVLogger
from exogym.runs.timeline import read_timeline
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, GossipStrategy, OptimSpec

FIT = dict(progress=False, device="cpu", batch_size=8, val_size=16)
NET = Network(bandwidth="100Mbps", latency="10ms")
SLOW = Network(bandwidth="1Mbps", latency="10ms")  # a gossip message is on the wire for several steps
SPEEDS = [1.0, 0.5, 0.25]  # node 2 is four times slower than node 0


def _fit(strategy, steps=20, **kw):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(), toy.make_classification(64, seed=1))
    trainer.fit(strategy, 3, max_steps=steps, val_interval=steps, network=NET, node_speeds=SPEEDS,
                logger=kw.pop("logger", False), **FIT, **kw)
    return trainer.record


def _seconds(lane, kind_letter):
    t = lane["t"]
    return sum(t[i + 1] - t[i] for i, k in enumerate(lane["kinds"]) if k == kind_letter)


def _check_tiles(record):
    """Each node's spans run from 0 to its clock with no gap, and sum to its clock's compute, wait and comm."""
    timeline = record.timeline
    for lane, clock in zip(timeline["lanes"], record.sim_time_per_node):
        t = lane["t"]
        assert t[0] == 0.0 and t[-1] == clock["now"], lane["name"]
        assert all(b > a for a, b in zip(t, t[1:])), "spans are contiguous and non-empty"
        assert len(lane["kinds"]) == len(t) - 1 == len(lane["steps"])
        assert all(a != b for a, b in zip(lane["kinds"], lane["kinds"][1:])), "a span continuing a kind is merged"
        assert math.isclose(_seconds(lane, "c") + _seconds(lane, "s"), clock["compute_s"] + clock.get("slowed_s", 0),
                            rel_tol=1e-9)
        assert math.isclose(_seconds(lane, "i") + _seconds(lane, "d"), clock["wait_s"], rel_tol=1e-9, abs_tol=1e-12)
    return timeline


def test_sync_diloco_fast_nodes_wait_for_the_slowest_and_spans_add_up():
    record = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5))
    timeline = _check_tiles(record)
    for lane, clock in zip(timeline["lanes"], record.sim_time_per_node):
        assert math.isclose(_seconds(lane, "m"), clock["comm_s"], rel_tol=1e-9)  # every transfer here blocks
    fast, slow = timeline["lanes"][0], timeline["lanes"][2]
    assert _seconds(fast, "i") > 0 and _seconds(slow, "i") == 0  # node 0 waits at each round for node 2
    # a round is compute, then (the fast ones) idle, then the all-reduce: 4 rounds, at most 3 spans each
    assert fast["kinds"] == "cim" * 4 and slow["kinds"] == "cm" * 4
    assert [fast["steps"][i] for i in range(0, 12, 3)] == [1, 6, 11, 16]  # each round's first step
    assert not timeline["messages"]["src"] and not timeline["updates"]["t"]


def test_links_busy_alike_share_one_lane_and_others_keep_their_own():
    # sync DiLoCo's all-reduce is one ring flow on every port (each node's up and down): one lane for the six ports;
    # async DiLoCo's uploads and replies make the server's two links busy at different times: a lane each
    for strategy, lanes_of in ((DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5),
                                [[f"port {r} {d}" for r in range(3) for d in ("down", "up")]]),
                               (AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5),
                                [["server down"], ["server up"]])):
        record = _fit(strategy)
        links = [lane for lane in record.timeline["lanes"] if lane["kind"] == "link"]
        assert [lane["links"] for lane in links] == lanes_of
        assert [lane["name"] for lane in links] == [names[0] + (f" +{len(names) - 1}" if len(names) > 1 else "")
                                                    for names in lanes_of]
        for lane in links:  # the lane's spans are each of its links' own, and add up to its busy time
            for name in lane["links"]:
                assert math.isclose(_seconds(lane, "b"), record.links[name]["busy_s"], rel_tol=1e-12)
        assert "link_spans" not in record.summary()["comm_per_node"][0]  # the links' own spans stay out of it


def test_async_diloco_sends_messages_that_become_updates():
    record = _fit(AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5))
    timeline = _check_tiles(record)
    lanes, m, u = timeline["lanes"], timeline["messages"], timeline["updates"]
    server = 3
    assert lanes[server]["kind"] == "server"
    to_server = [i for i in range(len(m["src"])) if m["dst"][i] == server]
    assert len(to_server) == len(record.updates) == len(u["t"]) > 0  # each pseudo-gradient sent is one update
    assert all(m["arrives"][i] > m["sent"][i] for i in range(len(m["src"])))
    # the server applies each update when its message arrives, for the node that sent it
    arrivals = sorted((m["arrives"][i], m["src"][i]) for i in to_server)
    assert [(t, lane) for t, lane in zip(u["t"], u["lane"])] == arrivals
    assert u["staleness"] == [row["staleness"] for row in record.updates]


def test_a_long_run_keeps_a_few_spans_a_round():
    short = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=2), steps=8).timeline
    long = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=2), steps=80).timeline
    for a, b in zip(short["lanes"], long["lanes"]):
        assert len(b["kinds"]) == 10 * len(a["kinds"])  # ten times the rounds, ten times the spans: none per step


def test_down_time_is_its_own_kind():
    record = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5), failures=[(0, 3, 12)])
    lane = record.timeline["lanes"][0]
    assert "d" in lane["kinds"] and "d" not in record.timeline["lanes"][1]["kinds"]
    assert lane["steps"][lane["kinds"].index("d")] <= 12


def test_slowed_time_is_its_own_kind():
    # node 1 runs 3 times slower from 0 to 10 simulated seconds (all of this toy run): its steps are one slowed span
    # a round (compute and stretch together), not a compute and a slowed span per step
    record = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5), slowdowns=[(1, 0.0, 10.0, 3.0)])
    lanes, clocks = record.timeline["lanes"], record.sim_time_per_node
    assert lanes[1]["kinds"] == "sm" * 4 and lanes[0]["kinds"] == "cim" * 4
    assert math.isclose(_seconds(lanes[1], "s"), clocks[1]["compute_s"] + clocks[1]["slowed_s"], rel_tol=1e-9)


def test_run_folder_holds_the_timeline_and_summary_does_not(tmp_path):
    record = _fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5), logger=CSVLogger(tmp_path, "run"))
    assert read_timeline(tmp_path / "run") == json.loads(json.dumps(record.timeline))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "timeline" not in summary and all("timeline" not in c for c in summary["comm_per_node"])


def test_resumed_run_has_the_uninterrupted_timeline(tmp_path):
    strategy = lambda: AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5)  # noqa: E731
    whole = _fit(strategy(), checkpoint_interval=10, checkpoint_dir=tmp_path, keep_checkpoints=2).timeline
    resumed = _fit(strategy(), resume_from=tmp_path / "step_000000010").timeline
    assert resumed["lanes"] == whole["lanes"] and resumed["updates"] == whole["updates"]
    assert resumed["messages"] == whole["messages"]  # the server's sent before the checkpoint too


@pytest.mark.parametrize("shared_links", [True, False])
def test_resumed_run_is_the_uninterrupted_one_with_flows_in_flight_at_the_checkpoint(shared_links, tmp_path):
    # asynchronous gossip over a slow network: the checkpoint at step 4 has messages' flows on the wire, their links
    # in the middle of a busy span. A checkpoint pauses the clocks (every node moves to the latest one's), and the
    # last step is always saved, so the resumed run checkpoints as the other did (else only its final pause differs)
    def fit(checkpoint_dir, **kw):
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(64))
        model = trainer.fit(GossipStrategy(OptimSpec.from_string("sgd", lr=0.1), topology="ring", mode="async"), 3,
                            max_steps=8, network=Network(bandwidth="1Mbps", latency="10ms", shared_links=shared_links),
                            node_speeds=SPEEDS, logger=False, checkpoint_interval=4, checkpoint_dir=checkpoint_dir,
                            **FIT, **kw)
        return trainer.record, model

    whole, whole_model = fit(tmp_path / "a")
    saved = torch.load(tmp_path / "a" / "step_000000004" / "node0.pt", weights_only=True)
    messages = whole.timeline["messages"]
    assert any(sent < saved["clock"]["now"] < arrives for sent, arrives in zip(messages["sent"], messages["arrives"]))
    if shared_links:  # flows in flight, links busy
        assert saved["strategy"]["messages"]["flows"]["flows"] and saved["strategy"]["messages"]["flows"]["peak"]
    resumed, resumed_model = fit(tmp_path / "b", resume_from=tmp_path / "a" / "step_000000004")
    assert all(torch.equal(a, b) for a, b in zip(whole_model.parameters(), resumed_model.parameters()))
    assert resumed.sim_time_per_node == whole.sim_time_per_node and resumed.time_per_node == whole.time_per_node
    assert resumed.timeline["lanes"] == whole.timeline["lanes"] and resumed.links == whole.links
    assert resumed.timeline["messages"] == whole.timeline["messages"]
    assert resumed.bytes_per_node == whole.bytes_per_node
    links = [lane for lane in whole.timeline["lanes"] if lane["kind"] == "link"]
    assert sorted(n for lane in links for n in lane["links"]) == sorted(whole.links)  # each link in one lane
    assert (bool(links) and "b" in links[0]["kinds"]) == shared_links


def test_chrome_trace_holds_every_span_message_and_update(tmp_path):
    record = _fit(AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5))
    path = record.export_trace(tmp_path / "trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    timeline = record.timeline
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == sum(len(lane["kinds"]) for lane in timeline["lanes"])
    # one thread per shared link after the nodes and the server, its spans with their flows at once
    links = [i for i, lane in enumerate(timeline["lanes"]) if lane["kind"] == "link"]
    assert links == [4, 5] and [timeline["lanes"][i]["name"] for i in links] == ["server down", "server up"]
    assert [e["args"]["flows"] for e in spans if e["tid"] == 4] == timeline["lanes"][4]["flows"]
    assert all(e["dur"] >= 0 and {"pid", "tid", "ts", "name"} <= set(e) for e in spans)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert [names[i] for i in range(len(timeline["lanes"]))] == [lane["name"] for lane in timeline["lanes"]]
    begins = [e for e in events if e["ph"] == "b"]
    ends = {e["id"]: e for e in events if e["ph"] == "e"}
    assert len(begins) == len(ends) == len(timeline["messages"]["src"])
    assert all(ends[b["id"]]["ts"] >= b["ts"] for b in begins)
    assert len([e for e in events if e["ph"] == "i"]) == len(record.updates)


def test_a_run_without_simulated_time_has_no_timeline(tmp_path):
    trainer = Trainer(toy.TinyMLP(), toy.make_classification())
    trainer.fit(DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=5), 2, max_steps=4, logger=False, **FIT)
    assert trainer.record.timeline is None
    with pytest.raises(ValueError, match="give fit a network="):
        trainer.record.export_trace(tmp_path / "t.json")
    with pytest.raises(FileNotFoundError, match="has a timeline once it completed"):
        read_timeline(tmp_path)
