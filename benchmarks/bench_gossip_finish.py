"""Memory at the end of an asynchronous gossip run: what its finish() adds to the run's peak, by K.

Each row is a fresh process running async gossip (ring, H=1) over K nodes of a 180-weight MLP for --steps steps
on the sim backend, and reports its resident memory when the last node enters finish() (every node has trained), the
run's peak (ru_maxrss) and node 0's bytes. "K x K counts" is the finish() before issue 46, rebuilt here for the
comparison: every node all-reduced a K x K int64 matrix of message counts (K^3 bytes in all), counted as traffic.
Usage: python benchmarks/bench_gossip_finish.py [--nodes 256 1024] [--steps 10] [--old-up-to 256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch
from torch.utils.data import TensorDataset

from exogym import Trainer
from exogym.comm import all_reduce, recv
from exogym.strategy import GossipStrategy

_AT_FINISH: dict[str, float] = {}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class Measured(GossipStrategy):
    def finish(self) -> None:
        _AT_FINISH["rss_mb"] = _rss_mb()  # the nodes enter one after another: the last one's stays
        super().finish()


class CountMatrix(Measured):
    """The finish() before issue 46."""

    def finish(self) -> None:
        _AT_FINISH["rss_mb"] = _rss_mb()
        counts = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.int64)
        counts[self.rank] = self._sent
        all_reduce(counts)
        for j in range(self.num_nodes):
            self._fold([recv(src=j) for _ in range(int(counts[j, self.rank] - self._taken[j]))])


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))  # 195

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


def _child(k: int, steps: int, old: bool) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=g)
    t = Trainer(_MLP(), TensorDataset(x, torch.randint(0, 3, (4096,), generator=g)))
    strategy = (CountMatrix if old else Measured)(topology="ring", mode="async", H=1, lr=0.05)
    t.fit(strategy, k, max_steps=steps, batch_size=4, progress=False, logger=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"at_finish": _AT_FINISH["rss_mb"], "peak": peak, "bytes0": t.record.bytes_per_node[0]}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--old-up-to", type=int, default=256)
    parser.add_argument("--child", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child[:2], bool(args.child[2]))
        return
    print(f"{'K':>5} {'finish':<13} {'RSS at finish MB':>16} {'peak MB':>8} {'peak - at finish':>16} {'node 0 bytes':>12}")
    for k in args.nodes:
        for old in ((False, True) if k <= args.old_up_to else (False,)):
            out = subprocess.run([sys.executable, __file__, "--child", str(k), str(args.steps), str(int(old))],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            name = "K x K counts" if old else "K counts"
            print(f"{k:>5} {name:<13} {r['at_finish']:>16.0f} {r['peak']:>8.0f} {r['peak'] - r['at_finish']:>16.0f} "
                  f"{r['bytes0']:>12}")


if __name__ == "__main__":
    main()
