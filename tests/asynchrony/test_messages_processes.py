"""Messages and the server when the sim spans processes (fit(processes=P)): the process holding node 0 keeps the
run's one event heap (the keeper), the others forward to it, and the run gives the same bits as one process:
parameters, updates, losses, bytes and simulated times; a checkpoint with messages in flight resumes exactly; a
recv nothing will match, a server that raises and a process that dies are errors naming them."""

import os
import signal
import time

import pytest
import torch

import toy
from exogym import Trainer
from exogym.backends.peer_watch import MIN_PEER_TIMEOUT
from exogym.comm import SERVER, MessageError, Server
from exogym.strategy import AsyncDiLoCoStrategy, FedBuffStrategy, Strategy
from exogym.strategy import communicate as comm

# The strategies and settings of the one-process checkpoint tests. On five nodes the blocks are (3, 2) and (2, 2, 1):
# a process other than the first holds two nodes, so the global model's mean (validation's, and the model fit
# returns) is exact only because its sum across processes is taken member by member in rank order.
from test_async_checkpoint import FIT, STRATEGIES  # noqa: E402

FIVE = dict(FIT, node_speeds=[1.0, 0.6, 0.3, 0.8, 0.5])


def _run(make, processes, steps=10, nodes=3, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(256), toy.make_classification(64, seed=1))
    fit = {**(FIT if nodes == 3 else FIVE), **kw}
    model = t.fit(make(), nodes, max_steps=steps, processes=processes, **fit)
    r = t.record
    return {"params": [p.detach().clone() for p in model.parameters()], "updates": r.updates,
            "loss": r.node_loss, "bytes": r.bytes_per_node, "received": [c.get("bytes_received") for c in r.comm_per_node],
            "times": r.sim_time_per_node, "val": r.val, "processes": r.config["processes"]}


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    for key in ("updates", "loss", "bytes", "received", "times", "val"):
        assert a[key] == b[key], key


@pytest.mark.spawns
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_one_two_and_three_processes_give_the_same_bits(name):
    one = _run(STRATEGIES[name], 1, nodes=5)
    assert one["processes"] == 1 and (one["updates"] or name.startswith("gossip"))
    for processes in (2, 3):
        many = _run(STRATEGIES[name], processes, nodes=5)
        assert many["processes"] == processes
        _same(one, many)


@pytest.mark.spawns
def test_fused_execution_over_two_processes_gives_what_it_gives_in_one():
    fused = STRATEGIES["async_diloco"]
    _same(_run(fused, 1, execution="fused"), _run(fused, 2, execution="fused"))


@pytest.mark.spawns
@pytest.mark.parametrize("name,every", [("async_diloco", 5), ("decoupled", 6), ("gossip_async", 5)])
def test_a_checkpoint_with_messages_in_flight_resumes_over_two_processes_bit_identically(name, every, tmp_path):
    make, cut = STRATEGIES[name], f"step_{every:09d}"
    one = _run(make, 1, checkpoint_interval=every, checkpoint_dir=tmp_path / "one", keep_checkpoints=5)
    whole = _run(make, 2, checkpoint_interval=every, checkpoint_dir=tmp_path / "whole", keep_checkpoints=5)
    messages = torch.load(tmp_path / "whole" / cut / "node0.pt", weights_only=True)["strategy"]["messages"]
    if name == "async_diloco":  # the server's model and version at the cut
        assert messages["server"]["state"]["version"] > 0
    else:  # messages in flight at the cut (decoupled: a grace window's timer or a fragment; gossip: pushes)
        assert messages["events"]
    resumed = _run(make, 2, checkpoint_interval=every, checkpoint_dir=tmp_path / "resumed", keep_checkpoints=5,
                   resume_from=tmp_path / "whole" / cut)
    _same(one, whole)
    _same(whole, resumed)


class Recorder(Server):
    def receive(self, m):
        if m.tag == 9:
            raise ValueError("boom")
        self.send(m.src, m.tensor * 2)


class Talks(Strategy):
    """Node r sends to the server and waits for its reply; node 1 (in the second process) also waits for a message
    from node 0 with tag 7 when `wait_for_node_0`, which nobody sends."""

    sends_messages = True

    def __init__(self, tag=0, wait_for_node_0=False):
        super().__init__()
        self.tag, self.wait_for_node_0 = tag, wait_for_node_0

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        comm.serve(Recorder)

    def step(self):
        comm.send(torch.tensor([float(self.rank)]), SERVER, tag=self.tag)
        comm.recv(src=SERVER)
        if self.wait_for_node_0 and self.rank == 1:
            comm.recv(src=0, tag=7)
        super().step()


def _talk(strategy, processes=2):
    Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(strategy, 2, max_steps=2, batch_size=4,
                                                            processes=processes, progress=False, logger=False)


@pytest.mark.spawns
def test_a_recv_no_send_will_match_across_processes_is_an_error_naming_the_node():
    with pytest.raises(MessageError, match="deadlock") as info:
        _talk(Talks(wait_for_node_0=True))
    assert "node 1: waits in recv from node 0 with tag 7 at step 1" in str(info.value)


@pytest.mark.spawns
def test_a_server_that_raises_across_processes_is_an_error_naming_the_message():
    with pytest.raises(MessageError, match=r"raised while handling message #0 from node \d to the server \(tag 9"):
        _talk(Talks(tag=9))


class Undeclared(Talks):
    sends_messages = False


@pytest.mark.spawns
def test_a_strategy_that_sends_without_declaring_it_is_told_to_across_processes():
    with pytest.raises(MessageError, match="set the class attribute sends_messages = True"):
        _talk(Undeclared())
    _talk(Undeclared(), processes=1)  # in one process it needs no declaration


class StopsOnNode2(AsyncDiLoCoStrategy):
    """Node 2's process dies (os._exit) or stops (SIGSTOP: hung, or cut off) at its third step."""

    def __init__(self, how, **kw):
        super().__init__(**kw)
        self.how = how

    def step(self):
        if self.rank == 2 and self.local_step == 3:
            if self.how == "dies":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGSTOP)
        super().step()


@pytest.mark.spawns
@pytest.mark.parametrize("how", ["dies", "stops"])
def test_a_process_that_dies_or_stops_while_the_keeper_waits_is_named(how):
    started = time.monotonic()
    with pytest.raises(Exception) as info:
        # peer_timeout at its least (5 s): the stopped process is named by its silence, not after the default 30 s
        _run(lambda: StopsOnNode2(how, H=2, lr=1e-2), 2, steps=8, node_timeout=3, peer_timeout=MIN_PEER_TIMEOUT)
    text = str(info.value)
    assert time.monotonic() - started < 60, text
    if how == "dies":
        assert "process 1 (nodes 2-2)'s process exited (code 3)" in text, text
    else:  # the keeper (node 0's process) waited for its status, and named it once its heartbeat stopped
        assert "process 1 (node 2) stopped responding" in text, text


class Wide(toy.TinyMLP):
    """An MLP whose matmuls round differently on one torch thread and on two (here the 10x32 @ 32x256 product of the
    last layer's gradient), and which refuses to compute on another thread count than two (so that the test
    shows the threads on a machine whose BLAS rounds alike)."""

    def __init__(self):
        super().__init__(dim=64, hidden=256, classes=10)

    def forward(self, batch):
        if torch.get_num_threads() != 2:
            raise RuntimeError(f"computing on {torch.get_num_threads()} torch threads, not the caller's 2")
        return super().forward(batch)


@pytest.mark.spawns
@pytest.mark.parametrize("make", [lambda: AsyncDiLoCoStrategy(H=5, outer_lr=0.7),
                                  lambda: FedBuffStrategy(H=2, buffer_size=2, lr=0.05)], ids=["async_diloco", "fedbuff"])
def test_two_processes_compute_with_the_callers_threads_and_give_one_process_bits(make):
    """Each process computes with the caller's torch threads (a kernel's rounding may depend on them), so a
    model whose matmuls do gives one process's bits; it differed by 2e-7 when the processes split the threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for processes in (1, 2):
            t = Trainer(Wide(), toy.make_classification(512, dim=64, classes=10))
            model = t.fit(make(), 4, max_steps=20, processes=processes, progress=False, device="cpu", logger=False,
                          batch_size=32)
            runs.append(([p.detach().clone() for p in model.parameters()], t.record.updates))
    finally:
        torch.set_num_threads(threads)
    (one, one_updates), (two, two_updates) = runs
    assert one_updates == two_updates and len(one_updates) > 4
    assert all(torch.equal(a, b) for a, b in zip(one, two)), max((a - b).abs().max().item() for a, b in zip(one, two))


def test_every_process_waiting_is_no_deadlock_while_a_link_packet_is_in_flight():
    """Issue 46 (3): 1,024 nodes over two processes ended now and then in a 'deadlock across processes' while the
    keeper took in process 1's 512 read_server questions and its status (each process waited with its progress
    unchanged for a second, the packets still on their way on a loaded machine). A deadlock now also needs every
    packet sent to have been taken in."""
    from torch.distributed import HashStore

    from exogym.backends.sim import exchange as ex

    store, owner = HashStore(), [0, 0, 1, 1]
    keeper, proxy = ex.Exchange(owner, 0, store, "run"), ex.Exchange(owner, 1, store, "run")
    try:
        proxy.report_stall("  node 2: waits in read_server at 0 s", 2, ({0: 3}, {0: 0}))  # 3 packets sent
        assert keeper.report_stall("  not waiting: nodes [0, 1]", 0, ({1: 0}, {1: 2})) is None  # 2 of them taken in
        proxy.report_stall("  node 2: waits in read_server at 0 s", 2, ({0: 3}, {0: 0}))
        everyone = keeper.report_stall("  not waiting: nodes [0, 1]", 0, ({1: 0}, {1: 3}))  # all in: a deadlock
        assert everyone is not None and "node 2: waits in read_server" in everyone
    finally:
        keeper.close()
        proxy.close()
