"""The asynchronous Local-SGD paper's toy study, on ExoGym's simulated clock.

    python examples/async_toy_study.py                   # 3 seeds, 4,000 total local updates each
    python examples/async_toy_study.py --seeds 0 --local-updates 1000    # a quick look
    python examples/async_toy_study.py --update-docs     # the published run: its JSON and two plots in docs/img

Liu, Chhaparia, Douillard et al., "Asynchronous Local-SGD Training for Language Modeling" (arXiv:2401.09135), and
the toy simulator that accompanies it (github.com/google-deepmind/asyncdiloco): classification of a mixture of
Gaussians (4 classes, 8 clusters per class, unit-norm centres, noise 0.5, iid shards, one per worker), four workers
whose steps take 0.58, 0.75, 1.51 and 3.33 seconds, H = 20 inner AdamW steps (weight decay 1e-3, batch 32, cosine
to 1e-6), an outer Nesterov step (momentum 0.9), no communication time. Runs: synchronous DiLoCo (outer
lr 0.7); asynchronous vanilla with constant and polynomial staleness weights (outer lr 0.035: the simulator's 0.07
times its 1/sqrt(K) weight); with Delayed Nesterov (the paper's Algorithm 3, c = 0, N = 4; outer lr 0.7); and with
Dynamic Local Updates from the given speeds (eq. 6). Every asynchronous run twice: as ExoGym runs by default (node r
reads shard r, the inner AdamW's state kept, no grace window) and with the framework's choices (grace window 0.5 s,
least-visited shard sampling with each shard's own cosine, a fresh AdamW per task), and DN + DyLU with each of the
three alone. Each run stops at the same
number of total local updates (the asynchronous ones at the simulated time that takes; the time axis is why
asynchrony pays). Loss of the server's model on held-out examples against total local updates and against
simulated time, over --seeds.

What was cut to run in minutes on two CPU cores: the input dimension (64 instead of 512), the hidden layer (256
instead of 65,000), the examples (32,000 instead of 128,000; 2,000 held out instead of 10,000) and the run's length
(4,000 total local updates, 50 synchronous rounds, instead of 32,000); the inner lr is 1e-3 instead of 2e-4, which
trains the cut model too slowly to tell the runs apart in that length. ExoGym's shards are redrawn each epoch
(DistributedSampler), the simulator's are fixed. Numbers to runs/async_toy_study.json (--update-docs: docs/img),
plots beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from exogym import Trainer
from exogym.cluster.network import Network
from exogym.models import MLPClassifier
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec
from published_output import add_update_docs, output_path, print_outputs

STEP_SECONDS = (0.58, 0.75, 1.51, 3.33)
CLASSES, CLUSTERS, NOISE, BATCH, H = 4, 8, 0.5, 32, 20
FRAMEWORK = dict(grace_s=0.5, shard_sampling="least_visited", inner_state="reset")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--local-updates", type=int, default=4000,
                        help="total local updates of every run (default 4000: 50 synchronous rounds)")
    parser.add_argument("--dim", type=int, default=64, help="input dimension (the paper's simulator: 512)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden units (the simulator: 65,000)")
    parser.add_argument("--examples", type=int, default=32000, help="training examples (the simulator: 128,000)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="the inner AdamW's peak learning rate (default 1e-3; the simulator's 2e-4 trains the cut "
                             "model too slowly to tell the runs apart in 4,000 updates)")
    parser.add_argument("--out", default=None, help="the JSON file (default runs/async_toy_study.json)")
    add_update_docs(parser, "async_toy_study.json and its two plots")
    args = parser.parse_args(argv)
    args.out = output_path(parser, args, "async_toy_study.json", given=args.out)
    return args


def mixture(n: int, dim: int, seed: int) -> TensorDataset:
    """n examples of CLASSES x CLUSTERS Gaussians (unit-norm centres, std NOISE), each cluster one class's."""
    gen = torch.Generator().manual_seed(seed)
    k = CLASSES * CLUSTERS
    centres = torch.randn(k, dim, generator=gen)
    centres = centres / centres.norm(dim=1, keepdim=True)
    cluster = torch.randint(k, (n,), generator=gen)
    x = centres[cluster] + NOISE * torch.randn(n, dim, generator=gen)
    return TensorDataset(x, cluster // CLUSTERS)  # clusters 0..7 are class 0, 8..15 class 1, ...


def runs(args: argparse.Namespace) -> list[tuple[str, object, dict]]:
    """(label, strategy, fit settings) of every run; the asynchronous ones stop at the time their nodes need, at
    their speeds, for the total local updates."""
    rounds = args.local_updates // (H * len(STEP_SECONDS))
    # seconds: all nodes compute, nobody waits; 10% more, for the grace window's idle time (read at the marks)
    budget = 1.1 * args.local_updates / sum(1.0 / s for s in STEP_SECONDS)
    timed = dict(max_steps=math.ceil(budget / STEP_SECONDS[0]) + H)
    cosine = dict(lr_scheduler="lambda_cosine", cosine_anneal=True, min_lr_factor=1e-6 / args.lr)
    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr, weight_decay=1e-3)
    out = [("sync DiLoCo", DiLoCoStrategy(adamw, H=H, outer_lr=0.7, outer_momentum=0.9, **cosine),
            dict(max_steps=rounds * H))]
    variants = [("async vanilla, constant", dict(outer_lr=0.035)),
                ("async vanilla, polynomial", dict(outer_lr=0.035, staleness="polynomial")),
                ("async + DN", dict(outer_lr=0.7, delayed_nesterov=True)),
                ("async + DN + DyLU", dict(outer_lr=0.7, delayed_nesterov=True, dynamic_local_updates="speeds"))]
    for framework in (False, True):
        for label, kw in variants:
            extra = {**FRAMEWORK, "shard_steps": rounds * H} if framework else {}
            strategy = AsyncDiLoCoStrategy(adamw, H=H, time_budget_s=budget, **kw, **extra, **cosine)
            out.append((label + (", framework" if framework else ""), strategy, timed))
    label, kw = variants[-1]  # the framework's choices one at a time, on DN + DyLU
    for name, one in (("grace only", dict(grace_s=FRAMEWORK["grace_s"])),
                      ("sampling only", dict(shard_sampling=FRAMEWORK["shard_sampling"], shard_steps=rounds * H)),
                      ("fresh inner only", dict(inner_state=FRAMEWORK["inner_state"]))):
        out.append((f"{label}, {name}", AsyncDiLoCoStrategy(adamw, H=H, time_budget_s=budget, **kw, **one, **cosine),
                    timed))
    return out


def step_flops(model: torch.nn.Module, batch) -> float:
    """FLOPs of one forward/backward (what the sim counts)."""
    with FlopCounterMode(display=False) as counter:
        model(batch)["loss"].backward()
    model.zero_grad()
    return float(counter.get_total_flops())


def one_run(args, label, strategy, fit, seed, train, val) -> list[dict]:
    """The run's evaluations: total local updates, simulated time, loss and accuracy of the global model."""
    torch.manual_seed(seed)
    model = MLPClassifier(args.dim, CLASSES, hidden=args.hidden)
    flops = step_flops(MLPClassifier(args.dim, CLASSES, hidden=args.hidden), train[:BATCH])
    trainer = Trainer(model, train, val)
    sync = label.startswith("sync")
    trainer.fit(strategy, len(STEP_SECONDS), batch_size=BATCH, val_size=len(val), seed=seed,
                val_interval=H if sync else 2 * H, node_speeds=[STEP_SECONDS[0] / s for s in STEP_SECONDS],
                device_flops=flops / STEP_SECONDS[0], compute_time="flops",
                network=Network(bandwidth="inf", latency=0.0), device="cpu", logger=False, progress=False, **fit)
    r = trainer.record
    at_step = {int(row["step"]): row.get("sim_time_s", 0.0) for row in r.train}
    return [{"local_steps": v.get("local_steps", v["step"] * len(STEP_SECONDS)),
             "sim_time_s": v.get("sim_time_s", at_step.get(int(v["step"]), 0.0)),
             "loss": v["global_loss"], "accuracy": v["global_accuracy"]} for v in r.val]


def loss_at(curve: list[dict], key: str, mark: float) -> float | None:
    """The loss of the last evaluation at or before `mark` (None if the run had none, or ended before it)."""
    if curve[-1][key] < mark - 1e-6 * max(1.0, mark):
        return None
    chosen = [p for p in curve if p[key] <= mark + 1e-6 * max(1.0, mark)]
    return chosen[-1]["loss"] if chosen else None


def summary(values: list[float | None]) -> str:
    if any(v is None for v in values):
        return "-"
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and the two cores are shared
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = mixture(args.examples + 2000, args.dim, seed=42)
    train = TensorDataset(*(t[:args.examples] for t in data.tensors))
    val = TensorDataset(*(t[args.examples:] for t in data.tensors))
    print(f"4 workers at {list(STEP_SECONDS)} s per step, H={H}; mixture of {CLASSES}x{CLUSTERS} Gaussians in "
          f"{args.dim} dims, MLP {args.dim}-{args.hidden}-{CLASSES}; {args.local_updates} total local updates; "
          f"seeds {args.seeds}\n", flush=True)
    results = []
    for label, _, _ in runs(args):
        curves = []
        for seed in args.seeds:
            _, strategy, fit = next(x for x in runs(args) if x[0] == label)  # a fresh strategy per run
            curves.append(one_run(args, label, strategy, fit, seed, train, val))
        results.append({"label": label, "curves": curves})
        print(f"{label:<38} final loss {summary([c[-1]['loss'] for c in curves])} at "
              f"{statistics.fmean(c[-1]['sim_time_s'] for c in curves):7.1f} s, "
              f"{statistics.fmean(c[-1]['local_steps'] for c in curves):.0f} local updates", flush=True)

    marks = [args.local_updates // 4, args.local_updates // 2, args.local_updates]
    budget = args.local_updates / sum(1.0 / s for s in STEP_SECONDS)  # asynchronous runs' time for them, no grace
    times = [round(budget / 4), round(budget / 2), round(budget)]
    print(f"\nLoss (mean ± sd over seeds {args.seeds}) at total local updates, and at simulated seconds (the last "
          "evaluation at or before each mark):\n")
    print("| run | " + " | ".join(f"{m} updates" for m in marks) + " | " + " | ".join(f"{t} s" for t in times) + " |")
    print("|---|" + "---|" * (len(marks) + len(times)))
    for x in results:
        by_updates = [summary([loss_at(c, "local_steps", m) for c in x["curves"]]) for m in marks]
        by_time = [summary([loss_at(c, "sim_time_s", t) for c in x["curves"]]) for t in times]
        x["loss_at_local_updates"] = dict(zip(map(str, marks), by_updates))
        x["loss_at_seconds"] = dict(zip(map(str, times), by_time))
        print(f"| {x['label']} | " + " | ".join(by_updates) + " | " + " | ".join(by_time) + " |")

    args.out.write_text(json.dumps({
        "command": "python examples/async_toy_study.py" + (" --update-docs" if args.update_docs else ""),
        "step_seconds": STEP_SECONDS, "H": H, "seeds": args.seeds, "local_updates": args.local_updates,
        "dim": args.dim, "hidden": args.hidden, "examples": args.examples, "runs": results}, indent=1) + "\n")
    written = [args.out]
    try:
        written += plot(results, args.out)
    except ImportError:
        print("\n(install matplotlib for the plots: pip install 'exogym[plot]')")
    print_outputs(written)


def plot(results: list[dict], out) -> list:
    """Mean loss over seeds against total local updates, and against simulated time: one PNG each."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    written = []
    for key, name, xlabel in (("local_steps", "async_toy_loss_vs_local_updates.png", "total local updates"),
                              ("sim_time_s", "async_toy_loss_vs_time.png", "simulated seconds")):
        fig = Figure(figsize=(8, 4.8), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for i, x in enumerate(results):
            if " only" in x["label"]:  # the one-at-a-time rows are in the table, not the plot
                continue
            n = min(len(c) for c in x["curves"])
            xs = [statistics.fmean(c[j][key] for c in x["curves"]) for j in range(n)]
            ys = [statistics.fmean(c[j]["loss"] for c in x["curves"]) for j in range(n)]
            style = "-" if x["label"].startswith("sync") else ("--" if "framework" in x["label"] else ":")
            ax.plot(xs, ys, style, color=f"C{i % 5}" if "framework" not in x["label"] else f"C{(i - 4) % 5}",
                    label=x["label"], linewidth=1.5)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out loss (mean over seeds)")
        ax.set_ylim(top=1.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out.parent / name
        fig.savefig(path, dpi=120)
        written.append(path)
    return written


if __name__ == "__main__":
    main()
