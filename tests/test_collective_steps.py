"""The sim pairs collectives by step as well as by order: a skipped or repeated call is an error, not a silent
mix of steps; async calls count at the step they were issued; a strategy may opt out."""

import pytest
import torch

import toy
from exogym import Trainer
from exogym.comm.transport import CollectiveError
from exogym.strategy import SimpleReduceStrategy, SPARTAStrategy, StreamingDiLoCoStrategy
from exogym.strategy import communicate as comm


class SkipsAndRepeats(SimpleReduceStrategy):
    """DDP, except that node 1 skips its all-reduce at step 4 and makes two at step 7 (same count, wrong steps)."""

    def step(self):
        step = self.local_step + 1
        calls = 1
        if self.rank == 1 and step == 4:
            calls = 0
        elif self.rank == 1 and step == 7:
            calls = 2
        for _ in range(calls):
            for p in self.model.parameters():
                comm.all_reduce(p.grad)
        self.optim.step()
        self.local_step += 1  # Strategy.step's count, without its schedule (there is none)


class MeansIt(SkipsAndRepeats):
    collectives_match_steps = False


def _fit(strategy, **kw):
    t = Trainer(toy.TinyMLP(), toy.make_classification(96))
    return t.fit(strategy, 3, batch_size=4, max_steps=8, progress=False, device="cpu", logger=False, **kw), t


def test_a_skipped_collective_names_the_nodes_and_their_steps():
    with pytest.raises(CollectiveError) as info:
        _fit(SkipsAndRepeats("sgd", lr=0.1))
    msg = str(info.value)
    assert "paired calls from different steps" in msg, msg
    assert "node 0 called all_reduce" in msg and "at step 4" in msg and "node 1 called all_reduce" in msg
    assert "at step 5" in msg and "collectives_match_steps = False" in msg


def test_a_strategy_that_means_it_opts_out():
    _fit(MeansIt("sgd", lr=0.1))  # the same calls, paired by order alone: runs to the end


def test_async_collectives_waited_later_match_on_the_step_they_were_issued():
    # Streaming DiLoCo issues each fragment's mean at one step and waits for it tau steps later; SPARTA's
    # averages arrive async_delay steps late.
    for strategy in (StreamingDiLoCoStrategy(H=4, num_fragments=2, tau=1, lr=0.01),
                     SPARTAStrategy(p_sparta=0.5, async_delay=2, lr=0.01)):
        _, t = _fit(strategy)
        assert t.record.train[-1]["step"] == 8
