"""How fast the web view opens in headless chromium, and how big a long run's timeline is.

- The timeline of a 64-node asynchronous run of 20,000 steps (H=20: each node computes 20 steps, sends its
  pseudo-gradient to the server and waits for the reply; node speeds from 1 to 0.25), and of a 64-node synchronous
  run of 2,000 rounds (H=10). Their spans are recorded by the clocks' own code (NodeClock, SpanLog: what a run
  records) on a schedule written here, not by training 1.28 million node-steps; the file is what build_timeline
  writes.
- The runs list of 1,000 run folders (copies of one small real run folder, renamed).

Times are from the page's navigation start to the view drawn (plotly.min.js's 4.8 MB parsed included), the best of
`--repeat` loads in one browser. Usage: python benchmarks/bench_ui.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exogym.cluster.network import SERVER, Network  # noqa: E402
from exogym.cluster.simtime import NodeClock  # noqa: E402
from exogym.cluster.spans import SpanLog  # noqa: E402
from exogym.runs.timeline import build_timeline, write_timeline  # noqa: E402
from exogym.ui.browser import headless_page, served  # noqa: E402

MODEL_BYTES = 4 * 100_000  # a 100k-parameter model's pseudo-gradient


def async_run(nodes: int = 64, steps: int = 20_000, H: int = 20) -> dict:
    """Each node: H steps of compute, a send to the server (waited on), the reply's wait; the server replies at once."""
    net, rng = Network(bandwidth="1Gbps", latency="20ms"), random.Random(0)
    clocks = [NodeClock(spans=SpanLog()) for _ in range(nodes)]
    speeds = [1.0 - 0.75 * r / max(1, nodes - 1) for r in range(nodes)]
    server_sent, updates, version = SpanLog(), [], 0
    per_round = []
    for rank, clock in enumerate(clocks):
        for rnd in range(steps // H):
            clock.spans.step = rnd * H + 1
            for _ in range(H):
                clock.add_compute(0.05 / speeds[rank] * (1 + 0.1 * rng.random()))
            sent, arrives = clock.now, clock.now + net.message_seconds(MODEL_BYTES, rank, SERVER)
            clock.spans.sent(SERVER, sent, arrives, MODEL_BYTES)
            clock.transfer_until(arrives)
            per_round.append((arrives, rank))
            back = arrives + net.message_seconds(MODEL_BYTES, SERVER, rank)
            server_sent.sent(rank, arrives, back, MODEL_BYTES)
            clock.catch_up(back)
    for at, rank in sorted(per_round):
        version += 1
        updates.append({"sim_time_s": at, "node": rank, "staleness": min(version - 1, nodes - 1)})
    comm = [{"timeline": c.spans.to_plain()} for c in clocks]
    comm[0]["server"] = {"updates": updates, "messages": server_sent.to_plain()["messages"]}
    return build_timeline(comm)


def sync_run(nodes: int = 64, rounds: int = 2_000, H: int = 10) -> dict:
    """Each round: H steps of compute per node, everyone waits for the slowest, then a ring all-reduce."""
    net, rng = Network(bandwidth="1Gbps", latency="20ms"), random.Random(0)
    clocks = [NodeClock(spans=SpanLog()) for _ in range(nodes)]
    speeds = [1.0 - 0.75 * r / max(1, nodes - 1) for r in range(nodes)]
    duration = net.duration("all_reduce", MODEL_BYTES, range(nodes))
    for rnd in range(rounds):
        for rank, clock in enumerate(clocks):
            clock.spans.step = rnd * H + 1
            for _ in range(H):
                clock.add_compute(0.05 / speeds[rank] * (1 + 0.1 * rng.random()))
        start = max(c.now for c in clocks)
        for c in clocks:
            c.leave_collective(c.now, start, start + duration)
    return build_timeline([{"timeline": c.spans.to_plain()} for c in clocks])


def many_runs(root: Path, n: int) -> None:
    """n copies of one small real run folder (a 2-node DiLoCo run), renamed."""
    import torch
    from torch.utils.data import TensorDataset

    from exogym import Trainer
    from exogym.runs.loggers import CSVLogger
    from exogym.strategy import DiLoCoStrategy

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.lin(x), y)

    x = torch.randn(256, 4)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    Trainer(Tiny(), data, data).fit(DiLoCoStrategy(H=5), 2, max_steps=50, batch_size=8, val_size=16, val_interval=10,
                                    logger=CSVLogger(root, "run-0000"), progress=False, network="low")
    for i in range(1, n):
        shutil.copytree(root / "run-0000", root / f"run-{i:04d}")


def record_cost_us(n: int = 200_000) -> tuple[float, float]:
    """Microseconds a clock move takes with its SpanLog and without (compute steps, then a wait, as a round does)."""
    out = []
    for spans in (SpanLog(), None):
        clock = NodeClock(spans=spans)
        t0 = time.perf_counter()
        for i in range(n):
            clock.add_compute(0.01)
            if i % 10 == 9:
                clock.catch_up(clock.now + 0.5)
        out.append((time.perf_counter() - t0) / (n * 1.1) * 1e6)
    return out[0], out[1]


def open_ms(page, url: str, flag: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        page.goto("about:blank")
        page.goto(url)
        page.wait_for_function(f"document.body.dataset.{flag}", timeout=60_000)
        best = min(best, float(page.evaluate(f"document.body.dataset.{flag}")))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        timelines, lists = Path(tmp) / "timelines", Path(tmp) / "list"
        rows = []
        for name, make in (("async-64n-20000steps", async_run), ("sync-64n-2000rounds", sync_run)):
            t0 = time.perf_counter()
            timeline = make()
            (timelines / name).mkdir(parents=True)
            path = write_timeline(timelines / name, timeline)
            spans = sum(len(lane["kinds"]) for lane in timeline["lanes"])
            rows.append([name, spans, len(timeline["messages"]["src"]), path.stat().st_size / 1e6,
                         time.perf_counter() - t0])
        many_runs(lists, args.runs)
        with headless_page() as page:
            with served(timelines) as (base, token):
                for row in rows:
                    row.append(open_ms(page, f"{base}/?token={token}#timeline?run={row[0]}", "timelineDrawnAt",
                                       args.repeat))
            with served(lists) as (base, token):
                list_ms = open_ms(page, f"{base}/?token={token}#runs", "runsDrawnAt", args.repeat)
    print(f"load: {os.getloadavg()[0]:.2f} (1-minute average, 2 cores)")
    print("| timeline | spans | messages | timeline.json MB | recorded + written s | opens in ms (limit 3000) |")
    print("|---|---|---|---|---|---|")
    for name, spans, messages, mb, secs, ms in rows:
        print(f"| {name} | {spans:,} | {messages:,} | {mb:.1f} | {secs:.1f} | {ms:.0f} |")
    with_spans, without = record_cost_us()
    print(f"\nrecording: a clock move takes {with_spans:.2f} us with its SpanLog, {without:.2f} us without "
          f"(+{with_spans - without:.2f} us a step; a training step takes a millisecond or more)")
    print("\n| runs list | opens in ms (limit 2000) |\n|---|---|")
    print(f"| {args.runs} run folders | {list_ms:.0f} |")


if __name__ == "__main__":
    main()
