"""The engine's cost against a plain event loop: asynchronous DiLoCo through exogym against the same work with no
framework at all.

The anchor (`plain_event_loop`, about 60 lines) does the arithmetic `AsyncDiLoCoStrategy(H)` cannot avoid, the
cheapest plain way: K copies of the MLP 784-256-256-10 (benchmarks/workload.py), AdamW (lr 1e-3, torch's defaults
otherwise, as the strategy builds it); each node's batches of 32 gathered from its shard of a permutation of the
data drawn per epoch (DistributedSampler's order: `randperm` seeded 42 + epoch, node r taking every K-th index from
r, as fit(seed=42) shuffles); node i's inner step takes 1 / speed_i simulated seconds. A node's H inner steps read
nothing another node writes, so an event is a round: the node whose round ends earliest goes next (a heap, ties by
rank), runs its H steps, and its pseudo-gradient g = theta_start - theta_node goes to the server, which applies it
at once (outer Nesterov SGD, lr 0.7, momentum 0.9: m <- 0.9 m + g, theta <- theta - 0.7 (g + 0.9 m), as
AsyncDiLoCoServer); the node continues from a copy of theta. Each node's parameters are views of one flat tensor,
so a round's pseudo-gradient and reload are one operation each. No messages, no network, no records: the least
bookkeeping that orders the work. `--check` runs both on a small case (K=4) and shows that they compute the same
thing: the same server model to the bit and the same per-node losses.
Against it: `AsyncDiLoCoStrategy(H)` through `Trainer.fit` with the same K, speeds, model, optimizer and data
(no network model, no validation, no logger). Both are timed from the model and data given to the end (the anchor's
model copies and optimizers included, as fit's are). Printed: wall milliseconds per inner step (node-step) of
each, interleaved in one process, the fastest of --repeat, and the ratio, with the machine's load average;
--cpu-time: the process's CPU seconds instead of wall seconds (what other load on a shared machine moves least).
Usage: python benchmarks/bench_event_loop.py [--nodes 16] [--steps 100] [--H 10] [--repeat 3] [--cpu-time]
       python benchmarks/bench_event_loop.py --check
"""

from __future__ import annotations

import argparse
import copy
import heapq
import os
import time

import torch

from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec
from workload import MLP, fastest_interleaved, make_data

BATCH = 32
SEED = 42  # fit's default seed: the data order
CLOCK = time.perf_counter  # --cpu-time: time.process_time


def plain_event_loop(k: int, steps: int, H: int, speeds: list[float]) -> tuple[float, torch.Tensor, list[list]]:
    """The anchor (module docstring). Returns wall seconds per node-step, the server's theta and each node's
    losses."""
    torch.manual_seed(0)
    model, data = MLP(), make_data(k * BATCH * 4)
    xs, ys = data.tensors
    shard = len(data) // k
    start = CLOCK()
    nodes = [copy.deepcopy(model) for _ in range(k)]
    flats = []
    for m in nodes:  # the node's parameters become views of one flat tensor (values unchanged)
        flat, at = torch.cat([p.detach().reshape(-1) for p in m.parameters()]), 0
        for p in m.parameters():
            p.data, at = flat[at:at + p.numel()].view_as(p), at + p.numel()
        flats.append(flat)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in nodes]
    theta = flats[0].clone()  # [N] the server's model
    momentum = torch.zeros_like(theta)
    starts = [theta.clone() for _ in range(k)]  # the theta each node's round began from
    perms: dict[int, torch.Tensor] = {}  # epoch -> the data's permutation (the same for every node)
    done, clock, losses, events = [0] * k, [0.0] * k, [[] for _ in range(k)], []

    def schedule(r: int) -> None:  # node r's next round ends after min(H, steps left) steps of 1/speed seconds
        for _ in range(min(H, steps - done[r])):
            clock[r] += 1.0 / speeds[r]
        heapq.heappush(events, (clock[r], r))

    for r in range(k):
        schedule(r)
    while events:
        _, r = heapq.heappop(events)  # the round that ends earliest
        for _ in range(min(H, steps - done[r])):
            epoch, i = divmod(done[r], shard // BATCH)
            if epoch not in perms:
                perms[epoch] = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch))
            idx = perms[epoch][r::k][i * BATCH:(i + 1) * BATCH]  # [32] node r's i-th batch of the epoch
            optims[r].zero_grad()
            loss = nodes[r]((xs.index_select(0, idx), ys.index_select(0, idx)))  # xs[idx], cheaper
            loss.backward()
            optims[r].step()
            losses[r].append(loss.detach())
            done[r] += 1
        with torch.no_grad():  # the server applies the round's pseudo-gradient at once; theta back to the node
            g = starts[r] - flats[r]
            momentum.mul_(0.9).add_(g)
            theta.sub_(g + 0.9 * momentum, alpha=0.7)
            flats[r].copy_(theta)
            starts[r] = theta.clone()
        if done[r] < steps:
            schedule(r)
    return (CLOCK() - start) / (k * steps), theta, losses


def exogym_run(k: int, steps: int, H: int, speeds: list[float]) -> tuple[float, torch.Tensor, list[list]]:
    """AsyncDiLoCoStrategy on the same work. Returns wall seconds per node-step, the returned model's trainable
    parameters (flat) and each node's losses."""
    torch.manual_seed(0)
    trainer = Trainer(MLP(), make_data(k * BATCH * 4))
    start = CLOCK()
    model = trainer.fit(AsyncDiLoCoStrategy(OptimSpec(torch.optim.AdamW, lr=1e-3), H=H), k, max_steps=steps,
                        batch_size=BATCH, node_speeds=speeds, device="cpu", logger=False, progress=False, seed=SEED)
    seconds = (CLOCK() - start) / (k * steps)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return seconds, theta, trainer.record.node_loss


def check() -> None:
    """Both compute the same thing on a small case: the same server model to the bit, the same losses."""
    k, steps, H = 4, 14, 3
    speeds = [1.0, 0.77, 0.52, 0.31]  # no two rounds end at the same simulated time
    _, theta_a, losses_a = plain_event_loop(k, steps, H, speeds)
    _, theta_b, losses_b = exogym_run(k, steps, H, speeds)
    losses_a = [[float(v) for v in node] for node in losses_a]
    same_losses = losses_a == [[float(v) for v in node] for node in losses_b]
    gap = (theta_a - theta_b).abs().max().item()
    print(f"K={k}, {steps} steps, H={H}, speeds {speeds}: server model max |difference| {gap:.3g} "
          f"({'bit-identical' if torch.equal(theta_a, theta_b) else 'DIFFERENT'}); per-node losses "
          f"{'identical' if same_losses else 'DIFFERENT'}")
    if not (torch.equal(theta_a, theta_b) and same_losses):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--H", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpu-time", action="store_true", help="CPU seconds of this process instead of wall seconds")
    parser.add_argument("--check", action="store_true", help="only show that both compute the same thing (K=4)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    if args.check:
        check()
        return
    k = args.nodes
    speeds = [1.0 - 0.75 * i / max(1, k - 1) for i in range(k)]
    runs = {"plain event loop": plain_event_loop, "exogym async DiLoCo": exogym_run}
    for fn in runs.values():  # warm-up, short
        fn(k, args.H, args.H, speeds)
    best, load = fastest_interleaved({name: lambda fn=fn: fn(k, args.steps, args.H, speeds)[0]
                                      for name, fn in runs.items()}, args.repeat)
    print(f"K={k}, {args.steps} steps, H={args.H}, MLP 784-256-256-10, batch 32, AdamW, one thread, "
          f"{'CPU' if args.cpu_time else 'wall'} time, {os.cpu_count()} cores, load average (1 min, highest seen) "
          f"{load:.1f}\n")
    print("| run | ms per node-step | vs plain event loop |\n|---|---|---|")
    for name in runs:
        print(f"| {name} | {best[name] * 1e3:.3f} | {best[name] / best['plain event loop']:.3f}x |")


if __name__ == "__main__":
    main()
