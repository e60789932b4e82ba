"""What handing numpy's random stream from node to node costs, and what that is in a 32-node sim step.

The sim backend hands the baton over several times per node and step (a fused DDP step of 32 nodes: 64 times,
each node pausing at the compute rendezvous and in the all-reduce; strategies that communicate more, more).
At each hand-over the node's random streams are swapped: torch's, Python's, and numpy's process-wide legacy
stream (np.random.*), which user code may draw from. Two ways for numpy's, side by side in one process, interleaved, fastest of --repeat rounds:
  (a) np.random.get_state() / np.random.set_state() (tuple form) at every hand-over;
  (b) NumpyBaton (exogym.engine.rng): each node's own bit generator installed with np.random.set_bit_generator,
      the legacy cached Gaussian read with get_state at the pause and put back with set_state where one is cached.
Both are numpy's public API only. Three kinds of turns: nothing drawn, uniforms drawn, and a Gaussian left
cached at every pause (the worst case of (b)); the time of the draws alone is subtracted. Then the whole
NodeRNG hand-over (torch, Python and numpy), and a real fused run of 32 nodes (MLP 784-256-256-10, DDP, 32
examples per node) timed with each way: hand-overs counted per step, seconds per step.
Usage: python benchmarks/bench_rng_handover.py [--nodes 32] [--handovers 20000] [--repeat 7] [--steps 12]
       [--threads 0] [--no-run]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

from exogym.engine import rng as rng_module
from exogym.engine.rng import NodeRNG, NumpyBaton, _NumpyStream, node_seed

TURNS = {  # what each node draws from numpy once when seeded, and in each turn
    "nothing drawn": (lambda: None, lambda: None),
    "8 uniforms drawn": (lambda: None, lambda: np.random.rand(8)),
    "a Gaussian cached at every pause": (lambda: np.random.randn(1), lambda: np.random.randn(2)),
}


def per_turn_tuple(k: int, n: int, setup, draw) -> float:
    """(a): seconds per hand-over, get_state / set_state (tuple form) around each turn."""
    states = []
    for r in range(k):
        np.random.seed(r)
        setup()
        states.append(np.random.get_state())
    start = time.perf_counter()
    for i in range(n):
        r = i % k
        np.random.set_state(states[r])
        draw()
        states[r] = np.random.get_state()
    return (time.perf_counter() - start) / n


def per_turn_baton(k: int, n: int, setup, draw) -> float:
    """(b): seconds per hand-over, NumpyBaton's enter / leave around each turn."""
    baton = NumpyBaton()
    assert baton.swap, "this numpy does not pass the swap check: (b) would be (a)"
    streams = [_NumpyStream() for _ in range(k)]
    for r, s in enumerate(streams):
        baton.enter(s, seed=r)
        setup()
        baton.leave(s)
    start = time.perf_counter()
    for i in range(n):
        s = streams[i % k]
        baton.enter(s)
        draw()
        baton.leave(s)
    return (time.perf_counter() - start) / n


def per_turn_draw(n: int, draw) -> float:
    start = time.perf_counter()
    for _ in range(n):
        draw()
    return (time.perf_counter() - start) / n


def per_turn_node_rng(k: int, n: int, swap: bool) -> float:
    """Seconds per hand-over of NodeRNG (torch CPU, Python and numpy streams), nothing drawn."""
    baton = NumpyBaton(swap=swap)
    rngs = [NodeRNG(node_seed(0, r), torch.device("cpu"), baton=baton) for r in range(k)]
    for g in rngs:
        g.activate()
        g.deactivate()
    start = time.perf_counter()
    for i in range(n):
        g = rngs[i % k]
        g.activate()
        g.deactivate()
    return (time.perf_counter() - start) / n


def fused_run(k: int, steps: int, warmup: int, swap: bool) -> tuple[float, float]:
    """(seconds per step, hand-overs per step) of a fused DDP run of k nodes, numpy's stream handed over by (b)
    where swap else by (a)."""
    import warnings

    from workload import MLP, ddp_keeping_k_copies, make_data

    from exogym import Trainer
    from exogym.strategy import OptimSpec

    stamps: list[tuple[float, int]] = []
    handovers = [0]
    activate = NodeRNG.activate

    def counted(self):
        handovers[0] += 1
        activate(self)

    strategy = ddp_keeping_k_copies(OptimSpec(torch.optim.AdamW, lr=1e-3))

    class Timed(type(strategy)):
        def step(self):
            super().step()
            if self.rank == 0:
                stamps.append((time.perf_counter(), handovers[0]))

    saved = rng_module._swap_checked
    rng_module._swap_checked = None if swap else False  # False: every NumpyBaton takes path (a)
    NodeRNG.activate = counted
    try:
        torch.manual_seed(0)
        trainer = Trainer(MLP(), make_data(k * 32 * (steps + warmup)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Timed(OptimSpec(torch.optim.AdamW, lr=1e-3)), k, batch_size=32, max_steps=steps + warmup,
                        device="cpu", progress=False, logger=False, execution="fused")
    finally:
        NodeRNG.activate = activate
        rng_module._swap_checked = saved
    (t0, h0), (t1, h1) = stamps[warmup - 1], stamps[-1]
    return (t1 - t0) / steps, (h1 - h0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--handovers", type=int, default=20000, help="hand-overs per timed block")
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds; the fastest counts")
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each fused run")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the fused runs (0: default)")
    parser.add_argument("--no-run", action="store_true", help="skip the fused runs")
    args = parser.parse_args()
    k, n = args.nodes, args.handovers
    print(f"numpy {np.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} at the start")

    best: dict[tuple[str, str], float] = {}
    for _ in range(args.repeat):  # interleaved: a drift in machine load hits both ways alike
        for name, (setup, draw) in TURNS.items():
            for way, fn in (("a", lambda: per_turn_tuple(k, n, setup, draw)),
                            ("b", lambda: per_turn_baton(k, n, setup, draw)),
                            ("draw", lambda: per_turn_draw(n, draw))):
                t = fn()
                best[name, way] = min(t, best.get((name, way), t))
        for way, swap in (("a", False), ("b", True)):
            t = per_turn_node_rng(k, n, swap)
            best["NodeRNG", way] = min(t, best.get(("NodeRNG", way), t))

    print(f"\nnumpy's stream, us per hand-over ({k} nodes in turn, draws' own time subtracted; "
          f"fastest of {args.repeat} x {n}):")
    print(f"{'turn':34s} {'(a) get/set_state':>18s} {'(b) NumpyBaton':>15s} {'(a)/(b)':>8s}")
    for name in TURNS:
        a = (best[name, "a"] - best[name, "draw"]) * 1e6
        b = (best[name, "b"] - best[name, "draw"]) * 1e6
        print(f"{name:34s} {a:18.1f} {b:15.1f} {a / b:8.2f}")
    a, b = best["NodeRNG", "a"] * 1e6, best["NodeRNG", "b"] * 1e6
    print(f"{'whole NodeRNG hand-over (nothing)':34s} {a:18.1f} {b:15.1f} {a / b:8.2f}")
    a_ms = (best["nothing drawn", "a"] - best["nothing drawn", "draw"]) * 100 * 1e3
    b_ms = (best["nothing drawn", "b"] - best["nothing drawn", "draw"]) * 100 * 1e3
    print(f"numpy's share of 100 hand-overs: (a) {a_ms:.2f} ms, (b) {b_ms:.2f} ms")

    if args.no_run:
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # workload.py
    fused_run(k, 1, 1, True)  # the process's one-time costs (imports, kernels) outside the timings
    runs = {}
    for way, swap in (("a", False), ("b", True), ("a", False), ("b", True)):  # interleaved; the faster counts
        s, h = fused_run(k, args.steps, 2, swap)
        runs[way] = min((s, h), runs.get(way, (s, h)))
    print(f"\nfused DDP run, {k} nodes, MLP, 32 examples per node, {args.steps} timed steps, faster of 2 runs:")
    print(f"{'numpy hand-over':18s} {'hand-overs/step':>16s} {'ms/step':>9s} {'numpy hand-overs, ms/step':>26s}")
    for way, per in (("a", best["nothing drawn", "a"] - best["nothing drawn", "draw"]),
                     ("b", best["nothing drawn", "b"] - best["nothing drawn", "draw"])):
        s, h = runs[way]
        print(f"{'(' + way + ')':18s} {h:16.1f} {s * 1e3:9.1f} {h * per * 1e3:14.2f} ({h * per / s:5.1%})")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
