"""The torch backend (one process per node over gloo) beside the sim backend (all nodes in one process).

For K = 1, 2, 4, 8 nodes: a small CNN on MNIST-shaped synthetic data, DDP (gradient all-reduce every step),
batch 32 per node. Each configuration runs in a fresh process: a short warm-up fit, then the timed fit (for the
torch backend the warm-up also starts the forkserver the node processes are forked from; its time is shown as
"1st fit"). Peak memory: for sim, the process's peak RSS; for torch, the sum of every process's peak RSS: the
caller, each node process, and the forkserver (pages they share, such as torch's libraries, count once per
process, as RSS does).
--threads T sets the caller's intra-op threads (default: torch's, one per core); the torch backend's node processes
share them (T // K each, at least 1).
Usage: python benchmarks/bench_backends.py [--steps 50] [--nodes 1 2 4 8] [--repeat 3] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing.forkserver
import resource
import subprocess
import sys
import time

import torch

from workload import SmallCNN, make_data


def fit(backend: str, k: int, steps: int, batch: int) -> tuple[float, object]:
    from exogym import Trainer
    from exogym.strategy import OptimSpec, SimpleReduceStrategy

    trainer = Trainer(SmallCNN(), make_data(k * batch * steps))
    start = time.perf_counter()
    trainer.fit(SimpleReduceStrategy(OptimSpec(torch.optim.AdamW, lr=1e-3)), k, batch_size=batch, max_steps=steps,
                device="cpu", progress=False, logger=False, log_interval=50, backend=backend)
    return time.perf_counter() - start, trainer.record


def _peak_mb_of_pid(pid: int | None) -> float:
    """A live process's peak RSS from /proc (Linux); 0 where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, TypeError):
        return 0.0


def child(backend: str, k: int, steps: int, batch: int, threads: int) -> None:
    torch.set_num_threads(threads)
    first, _ = fit(backend, k, 5, batch)  # warm-up: kernel selection, allocator growth, the forkserver's start
    seconds, record = fit(backend, k, steps, batch)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    if backend == "torch":
        peak_mb += sum(c.get("process_peak_rss_mb") or 0.0 for c in record.comm_per_node)
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)  # private: Linux only
        peak_mb += _peak_mb_of_pid(server)
    print(json.dumps({"seconds": seconds, "first_seconds": first, "peak_mb": peak_mb}))


def measure(backend: str, k: int, steps: int, batch: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", backend, str(k), str(steps), str(batch), str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the fastest counts (least disturbed)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, *numbers = args.child
        return child(backend, *map(int, numbers))
    print(f"DDP, small CNN, {args.steps} steps, batch {args.batch}/node, torch {torch.__version__}, "
          f"{args.threads} threads in the caller")
    print(f"{'K':>3} {'sim s':>8} {'torch s':>8} {'torch/sim':>10} {'torch 1st fit s':>16} {'sim MB':>8} "
          f"{'torch MB':>9} {'torch/sim MB':>13}")
    for k in args.nodes:
        runs = {"sim": [], "torch": []}
        for _ in range(args.repeat):  # interleaved, so a disturbance hits both sides alike
            for backend in runs:
                runs[backend].append(measure(backend, k, args.steps, args.batch, args.threads))
        sim, tor = (min(r, key=lambda m: m["seconds"]) for r in runs.values())
        print(f"{k:>3} {sim['seconds']:>8.2f} {tor['seconds']:>8.2f} {tor['seconds'] / sim['seconds']:>10.2f} "
              f"{tor['first_seconds']:>16.2f} {sim['peak_mb']:>8.0f} {tor['peak_mb']:>9.0f} "
              f"{tor['peak_mb'] / sim['peak_mb']:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
