"""How a process of `fit(processes=P)` gets its part of the plan: torch's shared-memory reducers (one file
descriptor per tensor, the way before issue 46) against one buffer of bytes through a pipe (exogym.launch.pickling,
now), for exogym's GPT at a few depths (width 128, so the tensor count grows and the bytes stay small) and one wide
GPT (many bytes, few tensors).

Each row starts one process from the forkserver that hands it the model's state dict and reports when it holds it:
the time from start to held, and the process's peak RSS (ru_maxrss, every tensor read once) minus that of a process
handed nothing. The buffer is dropped once read: after the peak, a process holds one copy of its state either way.
Usage: python benchmarks/bench_plan_handoff.py
"""

from __future__ import annotations

import resource
import time

import torch

from exogym.launch.pickling import from_bytes, to_bytes
from exogym.launch.supervision import process_context
from exogym.models.gpt import GPT


def _held(state, conn) -> None:
    """Read every tensor (so that shared pages count in the RSS too), then report the peak RSS."""
    conn.send((sum(float(t.float().sum()) for t in state.values()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def _held_by_args(state, conn) -> None:
    _held(state, conn)


def _held_by_pipe(plan_conn, conn) -> None:
    _held(from_bytes(plan_conn.recv_bytes()), conn)


def _hand(ctx, how: str, state) -> tuple[float, float]:
    """Seconds from start to the state held, and the process's peak RSS in MB."""
    reader, writer = ctx.Pipe(duplex=False)
    start = time.perf_counter()
    if how == "args":
        proc = ctx.Process(target=_held_by_args, args=(state, writer))
        proc.start()
    else:
        plan_reader, plan_writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_held_by_pipe, args=(plan_reader, writer))
        proc.start()
        plan_reader.close()
        plan_writer.send_bytes(to_bytes(state))
        plan_writer.close()
    _, rss_kb = reader.recv()
    seconds = time.perf_counter() - start
    proc.join()
    return seconds, rss_kb / 1024


def main() -> None:
    ctx = process_context()
    _, base = _hand(ctx, "pipe", {})
    print(f"{'model':<18} {'tensors':>7} {'MB':>7} {'fds: s':>8} {'fds: +MB':>9} {'bytes: s':>9} {'bytes: +MB':>10}")
    for name, layers, width in (("GPT 2 x 128", 2, 128), ("GPT 6 x 128", 6, 128), ("GPT 24 x 128", 24, 128),
                                ("GPT 84 x 128", 84, 128), ("GPT 6 x 768", 6, 768)):
        torch.manual_seed(0)
        state = {k: v.clone() for k, v in GPT(65, 64, n_layer=layers, n_head=4, n_embd=width).state_dict().items()}
        mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        try:
            fd_s, fd_mb = _hand(ctx, "args", state)
            fds = f"{fd_s:>8.2f} {fd_mb - base:>9.1f}"
        except ValueError as e:  # multiprocessing's forkserver: "too many fds"
            fds = f"{str(e):>18}"
        pipe_s, pipe_mb = _hand(ctx, "pipe", state)
        print(f"{name:<18} {len(state):>7} {mb:>7.1f} {fds} {pipe_s:>9.2f} {pipe_mb - base:>10.1f}")


if __name__ == "__main__":
    main()
