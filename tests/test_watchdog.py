"""The sim's watchdog: a node that keeps the baton past node_timeout is named with its step and stack, and the
run stops; long steps below the timeout are left alone."""

import os
import time

import pytest
import torch

import toy
from exogym import Trainer
from exogym.backends.errors import DEFAULT_NODE_TIMEOUT, NodeTimeoutError
from exogym.backends.sim.watchdog import importing_torch
from exogym.strategy import SimpleReduceStrategy


class LoopsForever(SimpleReduceStrategy):
    """DDP, except that node 1 spins at step 3 instead of reaching its all-reduce."""

    def step(self):
        if self.rank == 1 and self.local_step + 1 == 3:
            spin_without_reaching_a_collective()
        super().step()


def spin_without_reaching_a_collective():
    n = 0
    while True:
        n += 1


class SlowSteps(SimpleReduceStrategy):
    """Every step of node 0 takes `seconds` before its all-reduce: slow, but never stuck."""

    def __init__(self, *args, seconds=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = seconds

    def step(self):
        if self.rank == 0:
            time.sleep(self.seconds)
        super().step()


def _fit(strategy, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(96))
    return t.fit(strategy, 3, batch_size=4, progress=False, device="cpu", logger=False, **kw)


@pytest.fixture(scope="module", autouse=True)
def _warm():
    """A process's first step imports much of torch (seconds on a loaded machine): not what these tests time."""
    _fit(SimpleReduceStrategy("sgd", lr=0.1), max_steps=1, node_timeout=None)


def test_a_node_that_never_reaches_its_collective_is_named_with_its_step_and_stack():
    started = time.monotonic()
    with pytest.raises(NodeTimeoutError) as info:
        _fit(LoopsForever("sgd", lr=0.1), max_steps=6, node_timeout=3.0)
    msg = str(info.value)
    assert info.value.rank == 1 and info.value.step == 3
    assert "node 1 ran for" in msg and "in step 3 without finishing it" in msg and "node_timeout=3 s" in msg, msg
    assert "in spin_without_reaching_a_collective" in msg and "test_watchdog.py" in msg  # its stack: where it spun
    assert "node 0 (step 3): all_reduce" in msg  # and who was waiting for it
    assert time.monotonic() - started < 60  # stopped, not hung


FORWARDS = [None]  # batched forwards since the nodes started (a fused step calls the model once for every node)


class CountsItsNodes(SimpleReduceStrategy):
    def _init_node(self, model, rank, num_nodes):
        super()._init_node(model, rank, num_nodes)
        FORWARDS[0] = 0  # the set-up's probes of the model are behind


class SpinsInItsSecondBatchedForward(toy.TinyMLP):
    def forward(self, batch):
        if FORWARDS[0] is not None:
            FORWARDS[0] += 1
            if FORWARDS[0] == 2:
                spin_without_reaching_a_collective()
        return super().forward(batch)


def test_a_batched_step_that_never_finishes_under_fused_execution_is_named_with_its_nodes_and_stack():
    FORWARDS[0] = None
    started = time.monotonic()
    t = Trainer(SpinsInItsSecondBatchedForward(), toy.make_classification(96))
    with pytest.raises(NodeTimeoutError) as info:
        t.fit(CountsItsNodes("sgd", lr=0.1), 3, batch_size=4, progress=False, device="cpu", logger=False,
              max_steps=6, node_timeout=3.0, execution="fused", val_interval=100)
    msg = str(info.value)
    assert info.value.rank == 0 and info.value.step == 2
    assert "the batched step of nodes [0, 1, 2] (fused execution; node 0 at step 2)" in msg, msg
    assert "in the batched step: nodes [0, 1, 2]" in msg
    assert "node_timeout=3 s" in msg and "in spin_without_reaching_a_collective" in msg  # and its stack
    assert time.monotonic() - started < 60  # stopped, not hung


def test_long_steps_below_the_timeout_do_not_fire():
    # Node 0 holds the baton 1.3 s in each of 2 steps: 2.6 s in all, longer than the timeout, each step below it.
    _fit(SlowSteps("sgd", lr=0.1, seconds=1.3), max_steps=2, node_timeout=2.0)


def test_node_timeout_is_validated_and_none_disables_it():
    with pytest.raises(ValueError, match="node_timeout must be > 0, got 0"):
        _fit(SimpleReduceStrategy(), max_steps=1, node_timeout=0)
    with pytest.raises(TypeError, match="node_timeout must be a number, got '5'"):
        _fit(SimpleReduceStrategy(), max_steps=1, node_timeout="5")
    with pytest.raises(ValueError, match="node_timeout must be a finite number of seconds or None"):
        _fit(SimpleReduceStrategy(), max_steps=1, node_timeout=float("inf"))
    _fit(SimpleReduceStrategy(), max_steps=1, node_timeout=None)
    assert DEFAULT_NODE_TIMEOUT == 600.0


# Code that runs as the body of a torch module would (what a lazy `import torch._dynamo` runs): a module-level frame
# of a file in torch's folder. Nothing is written there; compile() only names the file.
_TORCH_MODULE_BODY = compile("import time\ntime.sleep(SECONDS)\nimport sys\nFRAME = sys._getframe()",
                             os.path.join(os.path.dirname(torch.__file__), "_exogym_test_module.py"), "exec")


class ImportsTorchSlowly(SimpleReduceStrategy):
    """Node 0's first step imports a torch module that takes longer than node_timeout (torch._dynamo under load)."""

    def step(self):
        if self.rank == 0 and self.local_step == 0:
            exec(_TORCH_MODULE_BODY, {"SECONDS": 2.5})
        super().step()


def test_time_spent_importing_torchs_own_modules_is_not_the_nodes():
    # Before, node 0 was stopped: "node 0 ran for 1.0 s in step 1 without finishing it ... node_timeout=1 s", inside torch's import.
    _fit(ImportsTorchSlowly("sgd", lr=0.1), max_steps=2, node_timeout=1.0)
    body = {"SECONDS": 0}
    exec(_TORCH_MODULE_BODY, body)
    assert importing_torch(body["FRAME"]) and not importing_torch(None)
    assert not importing_torch(__import__("sys")._getframe())  # a test's own frames: not torch's
