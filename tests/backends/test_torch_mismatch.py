"""Under the torch backend, nodes that call different collectives are named call by call, as the sim names them:
gloo aborts one process (or the collective times out) without saying what differed, so each node's calls go to
the run's store before they are launched, and the node that sees the collective fail compares them."""

import json

import pytest
import torch

import toy
from exogym import Trainer
from exogym.backends.errors import NodeProcessError
from exogym.backends.sim.baton import CollectiveCall
from exogym.backends.torch.heartbeat import CollectiveLedger, _with_last_call, describe_call, mismatch_report
from exogym.comm.transport import CollectiveError
from exogym.strategy import SimpleReduceStrategy, communicate


class Rank1OtherShape(SimpleReduceStrategy):
    """DDP, plus one all-reduce at step 2 where node 1's tensor has 5 entries and node 0's 3."""

    def step(self):
        if self.local_step + 1 == 2:
            communicate.all_reduce(torch.zeros(5 if self.rank == 1 else 3))
        super().step()


class Rank1Broadcasts(SimpleReduceStrategy):
    """DDP, plus one collective at step 2: node 0 all-reduces, node 1 broadcasts (both wait, until the timeout)."""

    def step(self):
        if self.local_step + 1 == 2:
            t = torch.zeros(4)
            communicate.broadcast(t, src=0) if self.rank == 1 else communicate.all_reduce(t)
        super().step()


def _fit(strategy, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    return t.fit(strategy, 2, batch_size=8, max_steps=4, progress=False, logger=False, device="cpu",
                 backend="torch", **kw)


@pytest.mark.spawns
def test_a_shape_mismatch_names_each_nodes_call():
    # Before: gloo aborted one process, and the report said the other "never reached all_reduce" it had reached.
    with pytest.raises((CollectiveError, NodeProcessError)) as info:
        _fit(Rank1OtherShape("sgd", lr=0.1), node_timeout=60.0)
    msg = str(info.value)
    assert "mismatched collective #2 on group [0, 1]" in msg, msg
    assert "node 0 (step 2): all_reduce((3,), 'float32', 'sum')" in msg, msg
    assert "node 1 (step 2): all_reduce((5,), 'float32', 'sum')" in msg, msg
    assert "never reached" not in msg


@pytest.mark.spawns
def test_a_mismatch_that_times_out_names_each_nodes_call():
    with pytest.raises((CollectiveError, NodeProcessError)) as info:
        _fit(Rank1Broadcasts("sgd", lr=0.1), node_timeout=3.0)
    msg = str(info.value)
    assert "mismatched collective #2 on group [0, 1]" in msg, msg
    assert "node 0 (step 2): all_reduce((4,), 'float32', 'sum')" in msg, msg
    assert "node 1 (step 2): broadcast((4,), 'float32', 'src=0')" in msg, msg
    assert "waited 3 s (fit's node_timeout) in" in msg, msg


def _ledger(*calls):
    ledger = CollectiveLedger()
    for op, signature in calls:
        ledger.enter(op, (0, 1, 2), 2, signature)
    return ledger


def test_a_member_that_stopped_at_an_earlier_call_is_compared_with_that_call():
    # A mismatched all-reduce can complete on one side: node 0 went on to call #3 while node 1 died in #2.
    same, other = ((3,), "float32", "sum"), ((5,), "float32", "sum")
    mine = _ledger(("all_reduce", same), ("all_reduce", same), ("all_reduce", same))
    ledgers = {1: _ledger(("all_reduce", same), ("all_reduce", other)).snapshot(step=2),
               2: _ledger(("all_reduce", same), ("all_reduce", same), ("all_reduce", same)).snapshot(step=2)}
    msg = mismatch_report(0, (0, 1, 2), mine.recent[(0, 1, 2)], ledgers)
    assert msg.startswith("mismatched collective #2 on group [0, 1, 2]"), msg
    assert "node 0 (step 2): all_reduce((3,), 'float32', 'sum')" in msg
    assert "node 1 (step 2): all_reduce((5,), 'float32', 'sum')" in msg
    assert "node(s) [2]: not known" in msg  # its last call is #3, which matches node 0's


def test_members_whose_calls_agree_are_no_mismatch():
    same = ((3,), "float32", "sum")
    mine = _ledger(("all_reduce", same), ("barrier", ()))
    ledgers = {1: _ledger(("all_reduce", same)).snapshot(step=2), 2: None}  # behind, and never published
    assert mismatch_report(0, (0, 1, 2), mine.recent[(0, 1, 2)], ledgers) is None


def test_calls_are_named_as_the_sim_names_them():
    sim = CollectiveCall("broadcast", ("broadcast", (2, 3), "bfloat16", "src=1"), {}).describe()
    published = _ledger(("broadcast", ((2, 3), "bfloat16", "src=1"))).snapshot(step=0)["calls"]["0,1,2"]
    assert describe_call(published[0], published[1]) == sim == "broadcast((2, 3), 'bfloat16', 'src=1')"


def test_what_a_node_publishes_per_call_stays_small_however_many_groups_it_used():
    # FedAvg's random islands give a new group nearly every round: the call published before each collective is
    # of constant size, and the ledger keeps the recent calls of the latest 64 groups only.
    ledger = CollectiveLedger()
    sizes = []
    for i in range(1000):
        ledger.enter("all_reduce", (i, i + 1), step=i, signature=((3,), "float32", "sum"))
        sizes.append(len(json.dumps(ledger.last_call())))
    assert max(sizes) - min(sizes) <= 12  # the digits of the ranks and the step only
    assert len(ledger.recent) == 64 and (999, 1000) in ledger.recent and (0, 1) not in ledger.recent
    assert ledger.counts[(0, 1)] == 1  # counts of every group stay: who never came is counted on them


def test_a_members_ledger_is_brought_up_to_the_call_it_published_last():
    published = {"step": 3, "counts": {"0,1": 4}, "calls": {"0,1": ["all_reduce", [[3], "float32", "sum"], 3, 4]},
                 "last": ["all_reduce", [0, 1], 3, 4]}
    last = {"group": "0,1", "call": ["broadcast", [[4], "float32", 0], 4, 5]}
    merged = _with_last_call(published, last)
    assert merged["counts"]["0,1"] == 5 and merged["calls"]["0,1"] == last["call"] and merged["step"] == 4
    assert merged["last"] == ["broadcast", [0, 1], 4, 5]
    assert _with_last_call(None, last)["calls"] == {"0,1": last["call"]}  # its ledger not yet published
    assert _with_last_call(published, None) is published
