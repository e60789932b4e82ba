"""State every node holds identically by construction is kept once in the sim, without moving a bit."""

import torch

from exogym.strategy import DiLoCoStrategy, OptimSpec, SPARTADiLoCoStrategy, StreamingDiLoCoStrategy
from strategy_toys import NODES, run_linear, watched

GRADS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0], [0.5, 0.5, 0.5]]
INIT = [1.0, 2.0, 3.0]
SGD = OptimSpec(torch.optim.SGD, lr=0.1)


def test_one_outer_model_for_all_nodes_and_grads_freed_after_the_inner_step():
    for cls, kwargs, index in ((DiLoCoStrategy, dict(H=3), 0), (SPARTADiLoCoStrategy, dict(H=3), 1),
                               (StreamingDiLoCoStrategy, dict(H=4, num_fragments=1, tau=0), 0)):
        run_linear(watched(cls)(SGD, **kwargs), GRADS, INIT, 7)
        outers = {id(NODES[r][1].modules[index].outer) for r in range(3)}
        assert len(outers) == 1  # one theta_g and one outer optimizer, not three
        assert all(p.grad is None for r in range(3) for p in NODES[r][0].parameters())


def test_overlapping_streaming_keeps_one_per_node():
    run_linear(watched(StreamingDiLoCoStrategy)(SGD, H=4, num_fragments=1, tau=1), GRADS, INIT, 7)
    assert len({id(NODES[r][1].modules[0].outer) for r in range(3)}) == 3
