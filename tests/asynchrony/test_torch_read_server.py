"""read_server from every rank on backend="torch": a rank other than 0 holds a shadow of the server (serve returns it)
and a read asks rank 0's server thread for the server's state between two messages it handles. The reads of a node
never go back, never pass the server's final version, and see the node's own earlier updates; the global model a
rank other than 0 computes at the end is the server's; a server without a state_dict is an error naming it; a read
of a stuck server ends the run naming the server. Also two fixes of the torch mailbox found on the way (poll, recv)."""

import time

import pytest
import torch

import toy
from exogym import ServerTimeoutError, Trainer
from exogym.comm import SERVER, Server, read_server, recv, send, serve
from exogym.strategy import AsyncDiLoCoStrategy, GossipStrategy, Strategy

FIT = dict(batch_size=8, backend="torch", progress=False, logger=False, device="cpu")


class VersionServer(Server):
    """Counts the messages it took (its version) and records each, with what the sender last read of it."""

    def __init__(self):
        super().__init__()
        self.version = 0

    def receive(self, message):
        self.version += 1
        self.record_update(node=message.src, staleness=0, weight=1.0, seen=message.meta["seen"])
        self.send(message.src, torch.tensor([float(self.version)]))

    def state_dict(self):
        return {"version": self.version}

    def load_state_dict(self, state):
        self.version = state["version"]


class ReadsTheVersion(Strategy):
    """Every node sends to the server every step and waits for its answer; node 2 reads the server's version every
    other step (through its shadow) and sends the last version it read with each message."""

    sends_messages = True

    def __init__(self, server=VersionServer):
        super().__init__()
        self.make, self.seen = server, -1.0

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        self.server = serve(self.make)
        assert isinstance(self.server, self.make)  # rank 0: the server; the others: a shadow

    def step(self):
        if self.rank == 2 and self.local_step % 2 == 0:
            self.seen = float(read_server(lambda s: s.version))
            assert self.server.version == self.seen and len(self.server.updates) == self.seen  # the shadow holds it
        if self.rank == 0:
            time.sleep(0.002)  # the others' messages come in between node 2's reads
        send(torch.zeros(1), SERVER, meta={"seen": self.seen})
        recv(src=SERVER)
        super().step()


@pytest.mark.spawns
def test_a_node_other_than_0_reads_the_server_monotonically_and_sees_its_own_updates():
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(ReadsTheVersion(), 3, max_steps=12, **FIT)
    updates = t.record.updates
    assert len(updates) == 36  # every message handled: the run completed
    mine = [i for i, u in enumerate(updates) if u["node"] == 2]
    seen = [updates[i]["seen"] for i in mine]
    assert seen == sorted(seen) and all(0 <= s <= len(updates) for s in seen), seen  # never back, never ahead
    for k in range(2, 12, 2):  # the read before node 2's k-th message came after its (k-1)-th was applied
        assert seen[k] >= mine[k - 1] + 1, (k, seen, mine)
    assert seen[-1] > seen[0]


class FastNodeTwo(AsyncDiLoCoStrategy):
    """AsyncDiLoCo whose nodes 0 and 1 sleep 30 ms a step, so node 2 finishes first; node 2 saves the global state
    it computes (the last one: at the end of the run) to `out`."""

    def __init__(self, out, **kwargs):
        super().__init__(torch.optim.SGD, H=2, lr=0.05, **kwargs)
        self.out = out

    def step(self):
        if self.rank != 2:
            time.sleep(0.03)
        super().step()

    def global_state(self):
        state = super().global_state()
        if self.rank == 2:
            torch.save({"state": state, "shadow": type(self.server).__name__}, self.out)
        return state


@pytest.mark.spawns
def test_a_node_other_than_0_reads_the_servers_model_as_its_global_state(tmp_path):
    out = tmp_path / "node2.pt"
    model = Trainer(toy.TinyMLP(), toy.make_classification(256)).fit(FastNodeTwo(str(out)), 3, max_steps=8,
                                                                     val_interval=100, **FIT)
    saved = torch.load(out)
    assert saved["shadow"] == "AsyncDiLoCoServer"
    # Node 2 finished first: the others' last updates came after its last answer, so the model it last received is
    # stale, and its global state must be what it read of the server at the end: the model fit returns (node 0's)
    for name, p in model.named_parameters():
        assert torch.equal(saved["state"][name], p.detach()), name


class Stateless(VersionServer):
    """A server keeping no state of its own (Server's empty state_dict): another rank cannot read it."""

    state_dict, load_state_dict = Server.state_dict, Server.load_state_dict


@pytest.mark.spawns
def test_a_server_without_a_state_read_from_another_rank_is_an_error_naming_what_to_define():
    with pytest.raises(Exception, match=r"read_server on node 2: .*Stateless must define state_dict\(\) and "
                                        r"load_state_dict\(\)"):
        Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(ReadsTheVersion(Stateless), 3, max_steps=2, **FIT)


class StuckInItsState(VersionServer):
    """Loops forever in its third state_dict: a read that rank 0's server thread never finishes answering."""

    calls = 0

    def state_dict(self):
        StuckInItsState.calls += 1
        while StuckInItsState.calls == 3:
            time.sleep(0.01)
        return super().state_dict()


@pytest.mark.spawns
def test_a_read_of_a_stuck_server_ends_the_run_naming_the_server_never_a_hang():
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError) as info:
        Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(ReadsTheVersion(StuckInItsState), 3, max_steps=12,
                                                                node_timeout=2.0, **FIT)
    e = info.value  # rank 0's watch names the server and the read it was answering; node 2 waits longer
    assert e.server == "StuckInItsState" and e.handling == "read_server request #2 from node 2", e.handling
    assert "time.sleep(0.01)" in str(e)
    assert time.monotonic() - start < 60


@pytest.mark.spawns
def test_asynchronous_gossip_runs_on_the_torch_backend():
    # Found on the way: a poll that took some messages and left others compared Messages with ==, whose tensors
    # made it an error ("Boolean value of Tensor with more than one value is ambiguous"), so push-sum gossip failed
    # on the torch backend as soon as a node polled with mail from that sender left over.
    t = Trainer(toy.TinyMLP(), toy.make_classification(256))
    model = t.fit(GossipStrategy(topology="ring", mode="async", H=2), 3, max_steps=8, val_interval=4, **FIT)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class TakesTheLaterTagFirst(Strategy):
    """Node 1 sends node 0 two messages, tags 1 then 2; node 0 takes tag 2 first, then tag 1."""

    sends_messages = True

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)

    def step(self):
        if self.rank == 1:
            send(torch.full((3,), 1.0), 0, tag=1)
            send(torch.full((3,), 2.0), 0, tag=2)
        else:
            assert recv(src=1, tag=2).tensor.tolist() == [2.0] * 3
            assert recv(src=1, tag=1).tensor.tolist() == [1.0] * 3
        super().step()


@pytest.mark.spawns
def test_a_recv_takes_a_later_message_before_an_earlier_one_of_the_same_sender():
    # recv took its message out of the mail with list.remove, which compares with ==: the earlier message's tensor
    # made that an error (or, with one element, could remove the wrong one)
    Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(TakesTheLaterTagFirst(), 2, max_steps=2, **FIT)
