"""How long a large grid sweep takes to start, and its peak memory: `exogym sweep` over an n x n x n grid.

Each size runs `exogym sweep --task synthetic --strategies diloco --H 1..n --outer-lr 0.01..1 --lr 1e-1..1e-n`
(n**3 configurations, one seed) in a fresh process and a fresh folder. Reported per grid: the seconds from the
command's start until it said its size (the count line) and until its first run wrote a row (train.csv); then the command is stopped with Ctrl-C (SIGINT) and its
peak resident memory read (ru_maxrss of that child, from wait4), with the trials the study held at that moment (the
queue, not the grid). The load average is printed beside, as the numbers depend on it.
Usage: python benchmarks/bench_sweep_grid.py [--sizes 10 100] [--out /tmp/bench-sweep-grid]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path


def _grid_args(n: int) -> list[str]:
    return (["--H", *map(str, range(1, n + 1)), "--outer-lr", *(f"{i / n:.4g}" for i in range(1, n + 1)),
             "--lr", *(f"1e-{i}" for i in range(1, n + 1))])


def _wait(pred, proc: subprocess.Popen, timeout: float = 600.0) -> float:
    start = time.monotonic()
    while not pred():
        if proc.poll() is not None or time.monotonic() - start > timeout:
            raise RuntimeError(f"the sweep ended (status {proc.returncode}) or took over {timeout} s")
        time.sleep(0.02)
    return time.monotonic()


def measure(n: int, out: Path) -> dict:
    folder = out / f"grid{n}"
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, "-m", "exogym.cli", "sweep", "--task", "synthetic", "--strategies", "diloco",
               "--nodes", "2", "--steps", "20", "--val-size", "64", *_grid_args(n), "--out", str(folder)]
    log = out / f"grid{n}.log"
    t0 = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        said = _wait(lambda: "configurations x" in log.read_text(), proc)
        runs = folder / "runs"
        first = _wait(lambda: any(runs.glob("*/train.csv")) if runs.exists() else False, proc)
        proc.send_signal(signal.SIGINT)
        _, _, usage = os.wait4(proc.pid, 0)  # this child's own peak (ru_maxrss, KiB)
    line = next(x for x in log.read_text().splitlines() if "configurations x" in x)
    import optuna  # after the child: the study as the sweep left it
    from exogym.sweep import load

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    trials = len(load(folder).study.study.get_trials(deepcopy=False))
    return {"n": n, "said_s": said - t0, "first_row_s": first - t0, "peak_mb": usage.ru_maxrss / 1024,
            "trials": trials, "count_line": line.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench-sweep-grid"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for n in args.sizes:
        r = measure(n, args.out)
        print(f"{n}^3 = {n ** 3:,} configurations: size said at {r['said_s']:.1f} s, first run's first row at "
              f"{r['first_row_s']:.1f} s, peak RSS {r['peak_mb']:.0f} MB, {r['trials']} trials in the study when "
              "stopped")
        print(f"  it said: {r['count_line']}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
