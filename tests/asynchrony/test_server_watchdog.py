"""A server stuck in its handler ends the run as stuck within node_timeout, naming the server and the message it
was handling: on the sim backend (the handler runs on the keeper, between the nodes' turns) and on the torch backend
(the server's thread in rank 0's process), also under torchrun."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

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
    # torch.optim's first step imports torch._dynamo, seconds under load: not inside node_timeout=1 s (first here
    # when this file runs alone)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
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


@pytest.mark.spawns
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


TORCHRUN_SCRIPT = """
import json, os, sys, time, torch
sys.path[:0] = [{tests!r}, {asynchrony!r}]
import toy
from exogym import Trainer
from test_server_watchdog import AsksTheServer

if __name__ == "__main__":
    torch.set_num_threads(1)
    start = time.monotonic()
    try:
        Trainer(toy.TinyMLP(), toy.make_classification(64)).fit(
            AsksTheServer(), 3, batch_size=4, max_steps=14, progress=False, device="cpu", node_timeout=2.0,
            logger=False, backend="torch")
        out = {{"error": None}}
    except Exception as e:
        out = {{"error": type(e).__name__, "text": str(e), "server": getattr(e, "server", None),
               "handling": getattr(e, "handling", None)}}
    out["took"] = time.monotonic() - start
    with open("rank" + os.environ["RANK"] + ".json", "w") as f:
        json.dump(out, f)
"""


@pytest.mark.spawns
def test_a_server_stuck_under_torchrun_is_named_by_its_rank_and_no_rank_hangs(tmp_path):
    # Three processes, the server on a thread of rank 0's: rank 0 names the server and the message once its handler
    # has run node_timeout (2 s); ranks 1 and 2, waiting for its answer, give up node_timeout and a grace (5 s)
    # after they began to wait, so rank 0's error is torchrun's first failure (or they raise rank 0's error, posted
    # in the job's store, if rank 0's exit reaches them first). Each rank catches its error and writes it down.
    here = Path(__file__).resolve().parent
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=str(here.parent), asynchrony=str(here)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    zero, *others = ranks
    assert zero["error"] == "ServerTimeoutError" and zero["server"] == "StuckOnce", ranks
    assert "to the server (tag 3" in zero["handling"] and "node_timeout=2 s" in zero["text"], ranks
    assert "time.sleep(0.01)" in zero["text"], ranks  # the server thread's stack
    for r, other in enumerate(others, 1):  # not gloo's timeout at node_timeout, racing rank 0's error
        waited = f"node {r} waited 7 s (fit's node_timeout and a grace) in recv from the server"
        assert (other["error"] == "MessageError" and waited in other["text"]) or other["server"] == "StuckOnce", ranks
    assert all(r["took"] < 60 for r in ranks), ranks
