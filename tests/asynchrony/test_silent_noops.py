"""No silent no-op (issue 46): FedBuff whose buffer the run cannot fill is refused before any node starts when that
is certain, and warned about once at the end when failures made it so; Decoupled DiLoCo whose min_quorum can no
longer form (nodes gone for good) is warned about once. The boundary values run without a word."""

import warnings

import pytest
import torch

import replay
from exogym import Trainer
from exogym.strategy import DecoupledDiLoCoStrategy, FedBuffStrategy, OptimSpec

FIT = dict(progress=False, device="cpu", logger=False, batch_size=8)


def _fit(strategy, steps=6, **kw):
    t = Trainer(replay.Pull(), replay.data())
    t.fit(strategy, 3, max_steps=steps, **FIT, **kw)
    return t


def _fedbuff(buffer_size):
    return FedBuffStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2, buffer_size=buffer_size)


def test_a_fedbuff_buffer_larger_than_the_run_can_fill_is_refused_before_any_node_starts():
    # 3 nodes x ceil(6 / 2) = 9 updates at most
    with pytest.raises(ValueError, match=r"buffer_size=10 .* at most 9 updates \(num_nodes=3 x ceil\(max_steps=6 / "
                                         r"H=2\)\)"):
        _fit(_fedbuff(10))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(_fit(_fedbuff(9)).record.updates) == 1  # the boundary: every update fills it once


def test_a_fedbuff_buffer_that_failures_left_unfilled_is_warned_about_once():
    with pytest.warns(RuntimeWarning, match=r"buffer_size=9 was never filled: the server applied 0 updates") as seen:
        t = _fit(_fedbuff(9), failures=[(2, 1, None)])  # node 2 gone from the start: 6 updates arrive
    assert len(t.record.updates) == 0
    assert sum("buffer_size" in str(w.message) for w in seen) == 1


def _decoupled(min_quorum):
    return DecoupledDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=0.25), H=2, min_quorum=min_quorum)


def test_a_decoupled_quorum_that_can_no_longer_form_is_warned_about_once():
    with pytest.warns(RuntimeWarning, match=r"min_quorum=3 can no longer form: only 2 node\(s\) are ever up "
                                            r"again") as seen:
        _fit(_decoupled(3), steps=12, failures=[(2, 5, None)])
    assert sum("min_quorum" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _fit(_decoupled(2), steps=12, failures=[(2, 5, None)])  # the boundary: two can still merge
        _fit(_decoupled(3), steps=12, failures=[(2, 5, 8)])  # back at step 8: the quorum forms again
