"""Per-node random streams survive any order of hand-overs, numpy's included (exogym.engine.rng)."""

import random

import numpy as np
import pytest
import torch

from exogym.engine import rng as rng_module
from exogym.engine.rng import GlobalRNGState, NodeRNG, NumpyBaton, node_seed

CPU = torch.device("cpu")
HAS_SWAP = hasattr(np.random, "set_bit_generator")  # numpy >= 1.25: the bit-generator hand-over is there


@pytest.fixture(autouse=True)
def _callers_numpy_stream():
    """Each test's process-wide numpy stream (object and state) is put back after it."""
    bg = np.random.get_bit_generator() if HAS_SWAP else None
    state = np.random.get_state(legacy=False)
    yield
    if HAS_SWAP:
        np.random.set_bit_generator(bg)
    np.random.set_state(state)


def _same_numpy_state(a, b) -> bool:
    """Public get_state() values (tuple form) equal, the cached Gaussian included."""
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


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


@pytest.mark.parametrize("swap", [True, False], ids=["bit-generator swap", "get_state/set_state"])
def test_numpy_stream_is_each_nodes_own_through_any_order_of_hand_overs(swap):
    if swap and not HAS_SWAP:
        pytest.skip("numpy < 1.25 has no set_bit_generator")
    seed, turns, k = 3, 7, 5
    expected = [_alone(r, seed, turns) for r in range(k)]
    baton = NumpyBaton(swap=swap)
    assert baton.swap is swap  # the path named is the path tested (this numpy passes the swap check)
    rngs = [NodeRNG(node_seed(seed, r), CPU, baton=baton) for r in range(k)]
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


def _numpy_turn(rank: int, turn: int) -> list[float]:
    """A node's turn drawing from numpy's legacy stream only, in a way fixed by (rank, turn): Gaussians in odd
    counts (one left cached), a single Gaussian (taking a cached one), uniforms, nothing, a reseed, or installing a
    bit generator of its own (numpy >= 1.25)."""
    what = np.random.RandomState([rank, turn, 7])  # its own stream: decides, never draws from the global one
    out: list[float] = []
    for _ in range(what.randint(1, 4)):
        action = what.randint(7 if HAS_SWAP else 6)
        if action == 0:
            out += np.random.randn(2 * what.randint(3) + 1).tolist()
        elif action == 1:
            out.append(float(np.random.standard_normal()))
        elif action == 2:
            out += np.random.normal(1.0, 2.0, size=3).tolist()
        elif action == 3:
            out += np.random.rand(2).tolist()
        elif action == 4:
            pass
        elif action == 5:
            np.random.seed(1000 * rank + turn)
        else:
            np.random.set_bit_generator(np.random.MT19937(1000 * rank + turn))
    return out


def _keeper_draws() -> None:
    """What runs between turns (the sim's keeper) may draw too, leaving a Gaussian cached."""
    np.random.randn(3)


def _get_state_set_state(k: int, seed: int, order: list[int]) -> tuple[list, list, int]:
    """The reference: numpy's stream saved with get_state and restored with set_state at every hand-over; and
    how many turns began with a Gaussian cached from the node's turn before."""
    states: list = [None] * k
    got: list[list] = [[] for _ in range(k)]
    cached = 0
    for r in order:
        cached += states[r] is not None and states[r][3] == 1
        if states[r] is None:
            np.random.seed(node_seed(seed, r) % 2**32)
        else:
            np.random.set_state(states[r])
        got[r].append(_numpy_turn(r, len(got[r])))
        states[r] = np.random.get_state()
        _keeper_draws()
    return got, states, cached


def _node_rngs(k: int, seed: int, order: list[int], swap: bool) -> tuple[list, list]:
    baton = NumpyBaton(swap=swap)
    assert baton.swap is swap
    rngs = [NodeRNG(node_seed(seed, r), CPU, baton=baton) for r in range(k)]
    got: list[list] = [[] for _ in range(k)]
    for r in order:
        rngs[r].activate()
        got[r].append(_numpy_turn(r, len(got[r])))
        rngs[r].deactivate()
        _keeper_draws()
    states = []
    for r in range(k):  # each node's stream as it stands, read in one more turn
        rngs[r].activate()
        states.append(np.random.get_state())
        rngs[r].deactivate()
    return got, states


@pytest.mark.parametrize("swap", [True, False], ids=["bit-generator swap", "get_state/set_state"])
@pytest.mark.parametrize("schedule", range(6))
def test_each_nodes_numpy_stream_is_what_get_state_set_state_gives_cached_gaussians_included(swap, schedule):
    """Random orders of hand-overs (runs of one node, alternations), nodes pausing with a cached Gaussian and
    taking it at their next turn, reseeding, installing their own bit generator, draws between turns: every
    node's draws, and its whole state at the end (cached Gaussian and its value included), are exactly those of
    get_state / set_state at each hand-over."""
    if swap and not HAS_SWAP:
        pytest.skip("numpy < 1.25 has no set_bit_generator")
    k, turns = 4, 12
    pick = np.random.RandomState(100 + schedule)
    order = [r for r in range(k) for _ in range(turns)]
    pick.shuffle(order)
    expected, expected_states, cached = _get_state_set_state(k, schedule, order)
    assert cached >= 3  # the case that matters is there: turns that begin with the node's own cached Gaussian
    got, states = _node_rngs(k, schedule, order, swap)
    assert got == expected
    assert all(_same_numpy_state(a, b) for a, b in zip(states, expected_states))


@pytest.mark.skipif(not HAS_SWAP, reason="numpy < 1.25 has no set_bit_generator")
def test_this_numpy_passes_the_swap_check_and_a_turn_installs_the_nodes_own_bit_generator(monkeypatch):
    """The hand-over this numpy gets is the bit-generator swap (so the tests above test it), and the check that
    decides it leaves the caller's stream as it found it: object, state, cached Gaussian."""
    callers = np.random.MT19937(5)
    np.random.set_bit_generator(callers)
    np.random.seed(5)
    np.random.randn(1)  # the caller has a Gaussian cached
    before = np.random.get_state()
    monkeypatch.setattr(rng_module, "_swap_checked", None)  # check again, now
    assert rng_module._swap_is_exact()
    assert np.random.get_bit_generator() is callers
    assert _same_numpy_state(np.random.get_state(), before)

    node = NodeRNG(node_seed(0, 0), CPU, baton=NumpyBaton())
    node.activate()
    assert np.random.get_bit_generator() is not callers
    np.random.rand(10)
    node.deactivate()
    assert np.random.get_bit_generator() is callers  # between turns: the caller's, its twister not moved
    assert _same_numpy_state(np.random.get_state()[:3], before[:3])


@pytest.mark.parametrize("swap", [True, False], ids=["bit-generator swap", "get_state/set_state"])
def test_a_resumed_node_continues_its_checkpointed_numpy_stream_cached_gaussian_included(swap):
    if swap and not HAS_SWAP:
        pytest.skip("numpy < 1.25 has no set_bit_generator")
    np.random.seed(11)
    np.random.randn(3)  # a Gaussian cached at the checkpoint
    saved = GlobalRNGState.from_plain(GlobalRNGState.capture().to_plain())  # as a checkpoint holds it
    assert saved.numpy[3] == 1
    expected = np.random.randn(5).tolist() + np.random.rand(2).tolist()

    np.random.seed(0)
    node = NodeRNG(node_seed(0, 1), CPU, saved, NumpyBaton(swap=swap))
    node.activate()
    got = np.random.randn(1).tolist()
    node.deactivate()
    node.activate()
    got += np.random.randn(4).tolist() + np.random.rand(2).tolist()
    node.deactivate()
    assert got == expected


def _keeps_cached_gaussian(real, real_get):
    def set_bit_generator(bg):  # a numpy whose swap left the legacy cached Gaussian in place
        before = np.random.get_state(legacy=False)
        real(bg)
        if before["has_gauss"]:
            np.random.set_state({**np.random.get_state(legacy=False), "has_gauss": 1, "gauss": before["gauss"]})
    return set_bit_generator, None


def _installs_a_copy(real, real_get):
    def set_bit_generator(bg):  # a numpy whose swap copied the bit generator's state in
        copy = type(bg)()
        copy.state = bg.state
        real(copy)
    return set_bit_generator, None


def _installs_a_copy_and_returns_the_original(real, real_get):
    given = {}

    def set_bit_generator(bg):
        copy = type(bg)()
        copy.state = bg.state
        given[id(copy)] = bg
        real(copy)

    def get_bit_generator():
        installed = real_get()
        return given.get(id(installed), installed)
    return set_bit_generator, get_bit_generator


@pytest.mark.skipif(not HAS_SWAP, reason="numpy < 1.25 has no set_bit_generator")
@pytest.mark.parametrize("numpy_that, swap_alone_exact", [(_keeps_cached_gaussian, False), (_installs_a_copy, True),
                                                          (_installs_a_copy_and_returns_the_original, False)])
def test_a_numpy_whose_swap_differs_gets_get_state_set_state(monkeypatch, numpy_that, swap_alone_exact):
    """The swap check is what keeps the fast path exact on another numpy: a swap that keeps the cached Gaussian,
    or installs a copy, fails it, and the baton then hands over with get_state / set_state. (Swapping regardless
    would be wrong on two of them; on the third, the pause sees another object installed and keeps its state.)"""
    set_bg, get_bg = numpy_that(np.random.set_bit_generator, np.random.get_bit_generator)
    monkeypatch.setattr(np.random, "set_bit_generator", set_bg)
    if get_bg is not None:
        monkeypatch.setattr(np.random, "get_bit_generator", get_bg)
    k, order = 3, [0, 0, 1, 2, 1, 0, 2, 2, 1, 0, 1, 2] * 2
    expected, _, _ = _get_state_set_state(k, 9, order)
    monkeypatch.setattr(rng_module, "_swap_checked", True)  # swapping without the check
    assert (_node_rngs(k, 9, order, swap=True)[0] == expected) is swap_alone_exact
    monkeypatch.setattr(rng_module, "_swap_checked", None)
    assert not rng_module._swap_is_exact()
    assert not NumpyBaton().swap
    assert _node_rngs(k, 9, order, swap=False)[0] == expected
