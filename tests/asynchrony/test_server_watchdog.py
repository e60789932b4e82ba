"""A server stuck in its handler ends the run as stuck within node_timeout, naming the server and the message it
was handling: on the sim backend (the handler runs on the hub, between the nodes' turns) and on the torch backend
(the server's thread in rank 0's process)."""

import json
import time

import pytest
import torch

import toy
from exogym import ServerTimeoutError, Trainer
from exogym.comm import SERVER, Server
from exogym.strategy import Strategy
from exogym.strategy import communicate as comm


STUCK_AT = 23  # past step 10, whose rows the nodes have handed over


class StuckOnce(Server):
    """Answers each message, but loops forever in its receive of the STUCK_AT-th one."""

    def __init__(self):
        super().__init__()
        self.handled = 0

    def receive(self, m):
        self.handled += 1
        if self.handled == STUCK_AT:
            while True:  # stuck: a Python loop that never returns
                time.sleep(0.01)
        self.send(m.src, m.tensor)


class AsksTheServer(Strategy):
    """Each step: send [rank, step] to the server and wait for its answer."""

    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        self.optim = torch.optim.SGD(model.parameters(), lr=0.0)
        comm.serve(StuckOnce)

    def step(self):
        comm.send(torch.tensor([float(self.rank), float(self.local_step)]), SERVER, tag=3)
        comm.recv(src=SERVER, tag=None)
        super().step()


def _fit(**kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(64))
    t.fit(AsksTheServer(), 2, batch_size=4, max_steps=14, progress=False, device="cpu", node_timeout=1.0, **kw)


def test_a_server_stuck_in_its_handler_ends_the_sim_run_as_stuck_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError) as info:
        _fit(logger=True, run_name="stuck")
    took = time.monotonic() - start
    e = info.value
    assert e.server == "StuckOnce" and "to the server (tag 3" in e.handling and "(message 23 it handled)" in e.handling
    assert "the server (StuckOnce) ran for" in str(e) and "node_timeout=1 s" in str(e)
    assert "time.sleep(0.01)" in str(e)  # the handler's stack
    assert took < 10, took  # within node_timeout (1 s) and the watchdog's sampling, never a hang
    summary = json.loads((tmp_path / "logs" / "stuck" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stuck"] is True
    assert summary["steps"] >= 1  # what the nodes completed is kept


def test_a_server_stuck_in_its_handler_ends_the_torch_run_as_stuck_naming_it():
    start = time.monotonic()
    with pytest.raises(ServerTimeoutError) as info:
        t = Trainer(toy.TinyMLP(), toy.make_classification(64))
        t.fit(AsksTheServer(), 2, batch_size=4, max_steps=14, progress=False, device="cpu", node_timeout=3.0,
              logger=False, backend="torch")
    took = time.monotonic() - start
    e = info.value
    assert e.server == "StuckOnce" and "to the server (tag 3" in e.handling
    assert "the server (StuckOnce) ran for" in str(e) and "node_timeout=3 s" in str(e)
    assert "time.sleep(0.01)" in str(e)  # the server thread's stack
    # the nodes waiting for its answer give up only after node_timeout and a grace (5 s), so the server is named
    # first; processes start in a few seconds
    assert took < 60, took
