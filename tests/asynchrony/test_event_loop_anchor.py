"""The speed anchor of benchmarks/bench_event_loop.py computes what AsyncDiLoCoStrategy computes: a ratio against a
loop doing other work (aliased parameters, another data order) would say nothing about the engine's cost."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_event_loop  # noqa: E402


def test_plain_event_loop_matches_exogym_to_the_bit():
    k, steps, H = 3, 8, 3
    speeds = [1.0, 0.77, 0.31]  # no two rounds end at the same simulated time, so both order them alike
    _, theta_loop, losses_loop = bench_event_loop.plain_event_loop(k, steps, H, speeds)
    _, theta_exogym, losses_exogym = bench_event_loop.exogym_run(k, steps, H, speeds)
    assert torch.equal(theta_loop, theta_exogym)
    assert [[float(v) for v in node] for node in losses_loop] == losses_exogym
