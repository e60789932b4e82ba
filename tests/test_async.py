"""async_op=True: results after wait(), the transfer overlapping compute on the virtual clock, no hangs."""

import math

import pytest
import torch

import toy
from exogym import Trainer
from exogym.comm.transport import CollectiveError
from exogym.cluster.network import Network
from exogym.strategy import Strategy
from exogym.strategy import communicate as comm

FIT = dict(progress=False, device="cpu", logger=False)


class AveragesParams(Strategy):
    """SGD, then averages a snapshot of the parameters: blocking, or launched async and waited on one step later."""

    def __init__(self, overlap: bool, **kwargs):
        super().__init__(**kwargs)
        self.overlap = overlap

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.05)
        self.work = None

    def step(self):
        self.optim.step()
        if self.work is not None:
            self.work.wait()
            toy.REGISTRY[("async", self.rank, self.local_step)] = self.snapshot.clone()
        self.snapshot = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        if self.overlap:
            self.work = comm.all_reduce(self.snapshot, async_op=True)
            if self.local_step + 1 == self.max_steps:
                self.work.wait()  # nothing may be left in flight when the node finishes
        else:
            comm.all_reduce(self.snapshot)
        super().step()


def _run(overlap, steps=6, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    t.fit(AveragesParams(overlap), 2, batch_size=8, max_steps=steps, **FIT, **kw)
    return t.record


def test_async_results_equal_the_blocking_ones():
    _run(True, steps=3)
    got = [toy.REGISTRY[("async", r, s)] for r in range(2) for s in (1, 2)]
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3])  # both nodes hold the same sum


def test_an_async_transfer_overlaps_compute_on_the_virtual_clock():
    net = Network(bandwidth="inf", latency=0.5)  # every all-reduce takes d = 0.5 s
    blocking = _run(False, network=net, device_flops=1e6)
    overlapped = _run(True, network=net, device_flops=1e6)
    c = blocking.sim_time_per_node[0]["compute_s"] / 6  # one step's compute
    d, n = 0.5, 6
    assert c < d
    assert math.isclose(blocking.sim_time_s, n * (c + d))
    # Overlapped: step k's transfer runs during step k+1's compute; only the last one is fully exposed.
    assert math.isclose(overlapped.sim_time_s, c + n * d)
    assert math.isclose(overlapped.sim_time_per_node[0]["comm_s"], n * d)


def test_waiting_on_a_collective_nobody_else_joins_is_reported():
    class Lonely(Strategy):
        def _init_node(self, model, rank, num_nodes):
            super()._init_node(model, rank, num_nodes)
            self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

        def step(self):
            if self.rank == 0:
                comm.all_reduce(torch.zeros(1), group=[0, 1], async_op=True).wait()
            else:
                comm.barrier(group=[1, 2])
            super().step()

    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    with pytest.raises(CollectiveError, match="deadlock") as info:
        t.fit(Lonely(), 3, batch_size=4, max_steps=1, **FIT)
    assert "node 0 (step 1): all_reduce((1,)" in str(info.value)
