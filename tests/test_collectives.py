"""The comm layer on the sim backend: results, byte counts, and misuse that would hang a real cluster."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.backends.sim.baton import CollectiveError
from exogym.comm.transport import all_gather_bytes, all_reduce_bytes, broadcast_bytes, reduce_scatter_bytes, Group
from exogym.strategy import OptimSpec, Strategy
from exogym.strategy import communicate as comm


class OneShot(Strategy):
    """Runs `action(self)` once, at the first step, on every node, and stores what it returns."""

    def __init__(self, action, tag, **kwargs):
        super().__init__(**kwargs)
        self.action, self.tag = action, tag

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(self):
        if self.local_step == 0:
            toy.REGISTRY[(self.tag, self.rank)] = self.action(self)
        super().step()


def run_on_nodes(action, nodes=3, tag=None, steps=1):
    tag = tag or action.__name__
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(64))
    trainer.fit(OneShot(action, tag), nodes, batch_size=4, max_steps=steps, progress=False, device="cpu")
    return [toy.REGISTRY[(tag, r)] for r in range(nodes)], trainer.record


def test_all_reduce_sums_in_rank_order_for_every_op_and_dtype():
    def action(s):
        r = s.rank
        out = {}
        for op in ("sum", "avg", "max", "min", "product"):
            t = torch.tensor([r + 1.0, -r - 2.0])
            comm.all_reduce(t, op=op)
            out[op] = t
        i = torch.tensor([r + 1, 10], dtype=torch.int32)
        comm.all_reduce(i, op=torch.distributed.ReduceOp.SUM)  # the original's spelling works too
        out["int"] = i
        return out

    results, _ = run_on_nodes(action)
    for res in results:
        assert res["sum"].tolist() == [6.0, -9.0]
        assert res["avg"].tolist() == [2.0, -3.0]
        assert res["max"].tolist() == [3.0, -2.0]
        assert res["min"].tolist() == [1.0, -4.0]
        assert res["product"].tolist() == [6.0, -24.0]
        assert res["int"].dtype == torch.int32 and res["int"].tolist() == [6, 30]


def test_broadcast_all_gather_reduce_scatter_and_subgroups():
    def action(s):
        r = s.rank
        b = torch.full((2,), float(r))
        comm.broadcast(b, src=2)
        outs = [torch.empty(1) for _ in range(3)]
        comm.all_gather(outs, torch.tensor([10.0 * r]))
        rs = torch.empty(2)
        comm.reduce_scatter(rs, [torch.full((2,), float(r * 3 + i)) for i in range(3)])
        pair = torch.tensor([float(r)])
        comm.all_reduce(pair, group=[0, 1] if r < 2 else [2])
        return b, torch.cat(outs), rs, pair

    results, _ = run_on_nodes(action)
    for r, (b, gathered, rs, pair) in enumerate(results):
        assert b.tolist() == [2.0, 2.0]
        assert gathered.tolist() == [0.0, 10.0, 20.0]
        # member r gets sum over nodes j of (3j + r) = 9 + 3r
        assert rs.tolist() == [9.0 + 3 * r] * 2
        assert pair.item() == (1.0 if r < 2 else 2.0)


def test_bytes_counted_per_node_match_each_ops_formula():
    n = 1000  # float32 elements -> 4000 bytes

    def action(s):
        t = torch.zeros(n)
        comm.all_reduce(t)
        comm.broadcast(t, src=1)
        comm.all_gather([torch.zeros(n) for _ in range(4)], t)
        comm.reduce_scatter(torch.zeros(n), [torch.zeros(n) for _ in range(4)])
        comm.barrier()
        return None

    _, record = run_on_nodes(action, nodes=4)
    world = Group((0, 1, 2, 3))
    for r in range(4):
        expected = (all_reduce_bytes(4000, 4) + broadcast_bytes(4000, world, 1, r) + all_gather_bytes(4000, 4)
                    + reduce_scatter_bytes(16000, 4))
        assert record.bytes_per_node[r] == expected
    assert all_reduce_bytes(4000, 4) == 6000  # 2 N (R-1)/R
    assert [broadcast_bytes(4000, world, 1, r) for r in range(4)] == [0, 4000, 4000, 4000]  # chain 1->2->3->0
    assert record.comm_per_node[0]["calls_by_op"] == {"all_reduce": 1, "broadcast": 1, "all_gather": 1,
                                                      "reduce_scatter": 1, "barrier": 1}


def _expect_collective_error(action, *fragments, nodes=3):
    with pytest.raises(CollectiveError) as info:
        run_on_nodes(action, nodes=nodes)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def test_mismatched_shapes_raise_naming_both_nodes():
    def action(s):
        comm.all_reduce(torch.zeros(3 if s.rank == 1 else 2))
    _expect_collective_error(action, "mismatched collective", "node 0", "node 1", "(3,)", "(2,)")


def test_different_collectives_raise():
    def action(s):
        t = torch.zeros(2)
        comm.broadcast(t, src=0) if s.rank == 2 else comm.all_reduce(t)
    _expect_collective_error(action, "mismatched", "broadcast", "all_reduce", "node 2")


def test_a_collective_only_some_nodes_call_raises_instead_of_hanging():
    def action(s):
        if s.rank == 0:
            comm.all_reduce(torch.zeros(2), group=[0, 1])
    # Node 1 moves on to the end-of-run averaging over all nodes; node 0 still waits for it on [0, 1].
    _expect_collective_error(action, "deadlock", "node 0 (step 1): all_reduce((2,)", "group [0, 1]")


def test_crossed_groups_deadlock_is_reported():
    def action(s):
        if s.rank == 0:
            comm.all_reduce(torch.zeros(1), group=[0, 1])
        elif s.rank == 1:
            comm.all_reduce(torch.zeros(1), group=[1, 2])
        else:
            comm.all_reduce(torch.zeros(1), group=[0, 2])
    _expect_collective_error(action, "deadlock", "group [0, 1]", "group [1, 2]", "group [0, 2]")


def test_a_node_exception_is_reraised_with_its_rank():
    def action(s):
        if s.rank == 2:
            raise KeyError("boom")
        comm.barrier()
    with pytest.raises(KeyError) as info:
        run_on_nodes(action)
    assert "raised in node 2 at step 1" in "".join(getattr(info.value, "__notes__", []))


def test_collectives_outside_a_run_and_bad_groups_are_clear_errors():
    with pytest.raises(RuntimeError, match="outside a running node"):
        comm.all_reduce(torch.zeros(1))

    def action(s):
        comm.all_reduce(torch.zeros(1), group=[1, 2])
    with pytest.raises(ValueError, match="node 0 called a collective on group \\[1, 2\\]"):
        run_on_nodes(action)

    def bad_src(s):
        comm.broadcast(torch.zeros(1), src=5)
    with pytest.raises(ValueError, match="src=5 is not in the group"):
        run_on_nodes(bad_src)


def test_per_member_lists_are_checked_before_anything_is_sent():
    def short_list(s):
        comm.all_gather([torch.zeros(2)] * 2, torch.zeros(2))
    with pytest.raises(ValueError, match=r"all_gather needs one tensor in tensor_list per group member \(3\), got 2"):
        run_on_nodes(short_list)

    def wrong_shape(s):
        comm.reduce_scatter(torch.zeros(2), [torch.zeros(2), torch.zeros(3), torch.zeros(2)])
    with pytest.raises(ValueError, match=r"reduce_scatter input_list\[1\] has shape \(3,\), but it must match \(2,\)"):
        run_on_nodes(wrong_shape)


def test_waiting_nodes_hand_back_their_reduction_buffers_and_get_the_exact_sum():
    # Sim nodes run in rank order: nodes 0..2 wait in the all-reduce while node 3 computes. Their flat buffers
    # are folded into one accumulator on arrival and give back their memory until they resume.
    held = {}

    def action(s):
        t = torch.arange(1000, dtype=torch.float32) * (s.rank + 1) / 7
        if s.rank == 3:
            held["while_waiting"] = [toy.REGISTRY[("buffer", r)].untyped_storage().nbytes() for r in range(3)]
        toy.REGISTRY[("buffer", s.rank)] = t
        comm.all_reduce(t)
        return t.clone()

    results, _ = run_on_nodes(action, nodes=4, tag="released")
    assert held["while_waiting"] == [0, 0, 0]
    parts = [torch.arange(1000, dtype=torch.float32) * (r + 1) / 7 for r in range(4)]
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]  # rank order, as the unfolded reduction sums
    assert all(torch.equal(r, want) for r in results)


class _InPlaceGather(Strategy):
    """All-gathers with its own slot of the output list as the input (torch.distributed allows it): the sim, which
    frees a waiting node's outputs until it resumes, must not free the input with them."""

    def __init__(self):
        super().__init__()
        self.optim_spec = OptimSpec(torch.optim.SGD, lr=0.1)
    def step(self):
        rank = comm.get_rank()
        outs = [torch.zeros(3) for _ in range(3)]
        outs[rank].fill_(rank + 1)
        comm.all_gather(outs, outs[rank])
        toy.REGISTRY[("inplace-gather", rank, self.local_step)] = [o[0].item() for o in outs]
        self.optim.step()
        super().step()


def test_an_all_gather_into_its_own_input_slot_gathers_every_node():
    Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(_InPlaceGather(), 3, batch_size=4, max_steps=2,
                                                            progress=False, logger=False)
    for rank in range(3):
        for step in range(2):
            assert toy.REGISTRY[("inplace-gather", rank, step)] == [1.0, 2.0, 3.0]
