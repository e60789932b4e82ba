"""The baton scheduler alone, with plain functions and a fake collective (no torch, no trainer)."""

import pytest

from exogym.backends.sim.baton import CollectiveCall, Baton
from exogym.comm.transport import CollectiveError


def make(n, trace):
    return Baton(n, on_resume=lambda r: trace.append(("in", r)), on_pause=lambda r: trace.append(("out", r)))


def meet(s, rank, group, value, box, op="sum"):
    """A fake collective whose effect is easy to pin: every member gets the list of values in rank order."""
    call = CollectiveCall(op, (op,), {"value": value, "box": box})

    def complete(calls):
        seen = [c.args["value"] for c in calls]
        for c in calls:
            c.args["box"].append(seen)

    s.rendezvous(rank, group, call, complete)


def test_only_one_node_runs_at_a_time_and_members_resume_in_rank_order():
    trace, events = [], []
    s = make(3, trace)

    def node(rank):
        def run():
            events.append(("start", rank))
            box = []
            meet(s, rank, (0, 1, 2), rank * 10, box)
            events.append(("after", rank, box[0]))
            return rank
        return run

    assert s.run([node(r) for r in range(3)]) == [0, 1, 2]
    assert events == [("start", 0), ("start", 1), ("start", 2),
                      ("after", 0, [0, 10, 20]), ("after", 1, [0, 10, 20]), ("after", 2, [0, 10, 20])]
    # The baton moves in and out strictly alternately: never two nodes "in" at once.
    inside = None
    for kind, r in trace:
        if kind == "in":
            assert inside is None
            inside = r
        else:
            assert inside == r
            inside = None


def test_a_node_that_finishes_while_its_group_waits_is_an_error():
    s = make(2, [])

    def waits():
        meet(s, 0, (0, 1), 1, [])

    def leaves():
        return None

    with pytest.raises(CollectiveError, match=r"node 1 (finished while node\(s\) \[0\] wait|.*already finished)"):
        s.run([waits, leaves])


def test_calling_a_collective_on_a_group_with_a_finished_node_is_an_error():
    s = make(2, [])

    def leaves():
        return None

    def late():
        s.rendezvous(1, (0, 1), CollectiveCall("sum", ("sum",), {}, step=4), lambda calls: None)

    with pytest.raises(CollectiveError, match=r"node 1 \(step 4\) called sum\(\) on group \[0, 1\], but node\(s\) "
                                              r"\[0\] already finished"):
        s.run([leaves, late])


def test_subgroups_run_independently_and_are_matched_by_order():
    s = make(4, [])
    got = {}

    def node(rank):
        def run():
            pair = (0, 1) if rank < 2 else (2, 3)
            first, second = [], []
            meet(s, rank, pair, rank, first)
            meet(s, rank, pair, rank + 100, second)
            got[rank] = (first[0], second[0])
        return run

    s.run([node(r) for r in range(4)])
    assert got[0] == got[1] == ([0, 1], [100, 101])
    assert got[2] == got[3] == ([2, 3], [102, 103])


def test_an_exception_unwinds_the_waiting_nodes():
    s = make(3, [])
    cleaned = []

    def node(rank):
        def run():
            try:
                if rank == 1:
                    raise ValueError("node 1 broke")
                meet(s, rank, (0, 1, 2), rank, [])
            finally:
                cleaned.append(rank)
        return run

    with pytest.raises(ValueError, match="node 1 broke"):
        s.run([node(r) for r in range(3)])
    assert sorted(cleaned) == [0, 1]  # node 0 unwound at once; node 2 never started
