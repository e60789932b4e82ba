"""read_server from every node in every process (sim): a node outside the keeper's process reads the server's state as
the keeper has it at the node's turn in simulated time, so a strategy reading the server gives the same bits over
processes=1, 2 and 3; and the global model's server entries are the server's when node 0 is down."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.comm import SERVER, Server, isend, read_server, serve
from exogym.strategy import AsyncDiLoCoStrategy, Strategy

from test_async_checkpoint import STRATEGIES  # noqa: E402
from test_messages_processes import _run, _same  # noqa: E402

# Nodes 0, 1 and 2 are down from step 6 to the end: the first node up is node 3, in the second process over 2 (blocks
# (3, 2)) and 3 processes (blocks (2, 2, 1)), so the global model's server entries (validation at step 10, the model
# fit returns) are node 3's read of the server.
DOWN_AT_THE_END = [(0, 6, None), (1, 6, None), (2, 6, None)]


class KeepsItsServer(AsyncDiLoCoStrategy):
    """AsyncDiLoCo whose server (in one process) is kept in toy.REGISTRY for the test to look at after the run."""

    def make_server(self, theta, num_nodes):
        server = super().make_server(theta, num_nodes)
        toy.REGISTRY["server"] = server
        return server


def test_with_node_0_down_at_the_end_the_global_model_is_the_servers():
    toy.REGISTRY.pop("server", None)
    model = Trainer(toy.TinyMLP(), toy.make_classification(256)).fit(
        KeepsItsServer(H=3, lr=1e-2), 5, max_steps=10, failures=DOWN_AT_THE_END, batch_size=8, progress=False,
        device="cpu", logger=False, node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5], network="home")
    # Node 3 (the first up) finishes before node 4, whose last update the server applies after node 3's last reply:
    # node 3's own copy is stale, and the global model must be the server's, as every node reads it at the end.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(flat, toy.REGISTRY["server"].theta)


@pytest.mark.spawns
@pytest.mark.parametrize("name", ["async_diloco", "fedbuff"])
def test_node_0_down_at_the_end_gives_the_same_bits_over_one_two_and_three_processes(name):
    one = _run(STRATEGIES[name], 1, nodes=5, failures=DOWN_AT_THE_END)
    assert one["val"][-1]["step"] == 10 and one["updates"]
    for processes in (2, 3):
        _same(one, _run(STRATEGIES[name], processes, nodes=5, failures=DOWN_AT_THE_END))


class CountingServer(Server):
    """Keeps the sum of the values it received and how many, and records each."""

    def __init__(self):
        super().__init__()
        self.total, self.count = torch.zeros(1), 0

    def receive(self, message):
        self.total += message.tensor
        self.count += 1
        self.record_update(node=message.src, staleness=0, weight=1.0, seen=message.meta["seen"])

    def state_dict(self):
        return {"total": self.total.clone(), "count": self.count}

    def load_state_dict(self, state):
        self.total, self.count = state["total"].clone(), state["count"]


class ReadsTheServer(Strategy):
    """Each node reads the server every step (its count, its total, its update rows and its clock) and sends what
    it read back; the server records it, so the record shows every node's reads, from every process."""

    sends_messages = True

    def __init__(self, server=None):
        super().__init__()
        self.make = server or CountingServer

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        self.server = serve(self.make)

    def step(self):
        count, total, rows, now = read_server(lambda s: (s.count, float(s.total), len(s.updates), s.now))
        assert self.server is not None and rows == count == self.server.count  # the shadow holds what was read
        isend(torch.tensor([float(self.rank + 1)]), SERVER, meta={"seen": count + total + now})
        super().step()


def _reads(processes):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(ReadsTheServer(), 5, max_steps=4, batch_size=4, processes=processes, progress=False, logger=False,
          node_speeds=[1.0, 0.5, 0.25, 0.8, 0.4], device_flops=1e4, network="home")
    return t.record.updates


@pytest.mark.spawns
def test_nodes_in_other_processes_read_the_server_as_in_one_process():
    one = _reads(1)
    for processes in (2, 3):  # nodes 3 and 4 in the second process (blocks (3, 2)); 2 and 3 (blocks (2, 2, 1))
        assert _reads(processes) == one, processes
    from_node_3 = [u["seen"] for u in one if u["node"] == 3]
    assert len(from_node_3) == 4 and from_node_3[-1] > from_node_3[0] > 0  # it saw the others' updates come in


class Stateless(CountingServer):
    """A server keeping no state of its own (Server's empty state_dict): another process cannot read it exactly."""

    state_dict, load_state_dict = Server.state_dict, Server.load_state_dict


@pytest.mark.spawns
def test_a_server_without_a_state_read_from_another_process_is_an_error_naming_what_to_define():
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    with pytest.raises(Exception, match=r"read_server on node 2: .*Stateless must define state_dict\(\) and "
                                        r"load_state_dict\(\)"):
        t.fit(ReadsTheServer(Stateless), 3, max_steps=2, batch_size=4, processes=2, progress=False, logger=False)
