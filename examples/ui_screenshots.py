"""The screenshots of docs/ui.md: `exogym ui` on the setting of docs/results.md section 7, shortened.

    python examples/ui_screenshots.py                 # run folders into runs/ui-demo, screenshots into runs/
    python examples/ui_screenshots.py --update-docs   # the screenshots into docs/img (ui_*.png)

Four nodes whose steps take 0.58, 0.75, 1.51 and 3.33 simulated seconds on a 10 Mbit/s, 50 ms WAN train the MNIST
MLP (examples/async_heterogeneous.py's setting): synchronous DiLoCo for --rounds rounds of H=20 steps, then
asynchronous DiLoCo (outer lr 0.1) for the same simulated time. Both write run folders under runs/ui-demo; the view
is then opened in headless chromium (Debian's, through Playwright) and photographed: the runs list, the two runs'
loss against simulated time, and each run's timeline. Needs the ui extra and chromium (apt-get install chromium).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from async_heterogeneous import BATCH, STEP_SECONDS, step_flops
from published_output import add_update_docs, output_path, print_outputs
from exogym import Trainer
from exogym.cluster.network import Network
from exogym.data.mnist import load_mnist
from exogym.models import MLPClassifier
from exogym.runs.loggers import CSVLogger
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec
from exogym.ui.browser import headless_page, served

H = 20


def train(root: Path, rounds: int) -> dict[str, float]:
    """The two runs' folders under `root`; returns each run's goodput."""
    network = Network(bandwidth="10Mbps", latency="50ms", shared_links=False)  # section 7's: each transfer alone
    train_set, test = load_mnist("train"), load_mnist("test")
    torch.manual_seed(0)
    flops = step_flops(MLPClassifier(784, 10, hidden=128), (train_set.tensors[0][:BATCH], train_set.tensors[1][:BATCH]))
    common = dict(batch_size=BATCH, val_size=1000, device="cpu", network=network, progress=False,
                  node_speeds=[STEP_SECONDS[0] / s for s in STEP_SECONDS], device_flops=flops / STEP_SECONDS[0])
    adamw = OptimSpec(torch.optim.AdamW, lr=1e-3)
    goodput, budget = {}, None
    for name in ("sync-diloco", "async-diloco"):
        torch.manual_seed(0)
        trainer = Trainer(MLPClassifier(784, 10, hidden=128), train_set, test)
        if budget is None:
            strategy, steps = DiLoCoStrategy(adamw, H=H), rounds * H
        else:  # the same simulated time; the fast nodes take more steps
            strategy = AsyncDiLoCoStrategy(adamw, H=H, outer_lr=0.1, time_budget_s=budget)
            steps = int(budget / STEP_SECONDS[0]) + H
        trainer.fit(strategy, 4, max_steps=steps, val_interval=H, logger=CSVLogger(root, name), **common)
        budget = budget or trainer.record.sim_time_s
        goodput[name] = trainer.record.goodput
    return goodput


def photograph(root: Path, first: Path) -> list[Path]:
    """The screenshots: `first` (the runs list), the others beside it; returns their paths."""
    img, shots = first.parent, [first]
    with served(root) as (base, token), headless_page(1400, 800) as page:
        page.goto(f"{base}/?token={token}#runs")
        page.wait_for_function("document.body.dataset.runsLoaded")
        page.screenshot(path=str(first), clip={"x": 0, "y": 0, "width": 1400, "height": 200})
        page.goto(f"{base}/?token={token}#compare?run=sync-diloco&run=async-diloco")
        page.wait_for_function("document.body.dataset.comparePoints")
        page.select_option("#x-axis", "sim_time_s")
        page.select_option("#y-axis", "val:global_loss")
        page.wait_for_timeout(500)
        shots.append(img / "ui_compare.png")
        page.screenshot(path=str(shots[-1]), clip={"x": 0, "y": 0, "width": 1400, "height": 520})
        for name in ("sync-diloco", "async-diloco"):
            page.goto("about:blank")
            page.goto(f"{base}/?token={token}#timeline?run={name}")
            page.wait_for_function("document.body.dataset.timelineDrawnAt")
            page.evaluate("state.timeline.zoomTo(0, 200)")  # the first rounds: where nodes wait, or do not
            shots.append(img / f"ui_timeline_{name.split('-')[0]}.png")
            page.screenshot(path=str(shots[-1]), clip={"x": 0, "y": 0, "width": 1400, "height": 330})
    return shots


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="synchronous DiLoCo's rounds (default 5)")
    parser.add_argument("--runs", default="runs/ui-demo", help="the folder of the two run folders (emptied first)")
    parser.add_argument("--out", default=None, help="the runs list's screenshot (default runs/ui_runs.png); the "
                                                    "others are written beside it")
    add_update_docs(parser, "ui_runs.png, ui_compare.png, ui_timeline_sync.png, ui_timeline_async.png")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "ui_runs.png", given=args.out, free=("runs",))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    root = Path(args.runs)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    goodput = train(root, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shots = photograph(root, args.out)
    for name, g in goodput.items():
        print(f"{name}: goodput {g:.2f}")
    print_outputs(shots)


if __name__ == "__main__":
    main()
