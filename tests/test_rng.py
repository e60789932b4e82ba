"""Per-node random streams survive any order of hand-overs, numpy's included (exogym.rng)."""

import random

import numpy as np
import torch

from exogym.rng import NodeRNG, NumpyBaton, node_seed


def _draw(rank: int, turn: int) -> list[float]:
    """What node `rank` draws on its `turn`-th turn: an odd number of legacy Gaussians on some turns (leaving one
    cached in numpy's RandomState), none on others, uniform numbers, Python's and torch's streams."""
    out = []
    if (rank + turn) % 3 == 0:
        out += np.random.randn(2 * rank + 1).tolist()
    if (rank + turn) % 2 == 0:
        out += np.random.rand(3).tolist()
    out += [random.random(), float(torch.rand(()))]
    return out


def _alone(rank: int, seed: int, turns: int) -> list[list[float]]:
    """The node's draws with nobody else in the process: its streams seeded as NodeRNG seeds them."""
    s = node_seed(seed, rank)
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s % 2**32)
    return [_draw(rank, t) for t in range(turns)]


def test_numpy_stream_is_each_nodes_own_through_any_order_of_hand_overs():
    seed, turns, k = 3, 7, 5
    expected = [_alone(r, seed, turns) for r in range(k)]
    baton = NumpyBaton()
    rngs = [NodeRNG(node_seed(seed, r), torch.device("cpu"), baton=baton) for r in range(k)]
    got = [[] for _ in range(k)]
    order = np.random.RandomState(0)
    left = {r: turns for r in range(k)}
    while left:  # an irregular order, with the same node often running twice in a row
        r = int(order.choice(sorted(left)))
        rngs[r].activate()
        got[r].append(_draw(r, turns - left[r]))
        rngs[r].deactivate()
        left[r] -= 1
        if not left[r]:
            del left[r]
    assert got == expected
