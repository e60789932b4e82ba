"""The `exogym` command: run a strategy on a built-in task, compare several, plot run folders.

    exogym run --task mnist --strategy ddp --nodes 4 --steps 200
    exogym compare --task synthetic --strategies ddp diloco sparta --nodes 4 --steps 100 --out compare.png
    exogym plot logs/run-a logs/run-b --x bytes --y global_loss --out loss_vs_bytes.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from exogym.strategy import Strategy
from exogym.strategy.optim import OptimSpec
from exogym.tasks import TASKS, get_task

__all__ = ["main", "STRATEGY_BUILDERS"]


def _inner(args: argparse.Namespace) -> OptimSpec:
    return OptimSpec.from_string(args.optim, lr=args.lr)


def _common(args: argparse.Namespace) -> dict:
    out = {"max_norm": args.max_norm}
    if args.warmup_steps:
        out.update(warmup_steps=args.warmup_steps, cosine_anneal=args.cosine)
    return out


def _ddp(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import SimpleReduceStrategy
    return SimpleReduceStrategy(_inner(args), **_common(args))


def _diloco(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import DiLoCoStrategy
    return DiLoCoStrategy(_inner(args), H=args.H, outer_lr=args.outer_lr, **_common(args))


def _sparta(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import SPARTAStrategy
    return SPARTAStrategy(_inner(args), p_sparta=args.p_sparta, **_common(args))


def _fedavg(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import FedAvgStrategy
    return FedAvgStrategy(_inner(args), H=args.H, island_size=args.island_size, **_common(args))


def _demo(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import DeMoStrategy
    return DeMoStrategy(lr=args.lr, compression_topk=args.topk, **_common(args))


# name -> builder(args): one name per strategy; each builder reads only the options that strategy has.
STRATEGY_BUILDERS: dict[str, Callable[[argparse.Namespace], Strategy]] = {
    "ddp": _ddp, "diloco": _diloco, "sparta": _sparta, "fedavg": _fedavg, "demo": _demo}


def _add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="synthetic", choices=sorted(TASKS),
                   help="; ".join(f"{t.name}: {t.description}" for t in TASKS.values()))
    p.add_argument("--nodes", type=int, default=4, help="number of simulated nodes (default 4)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--batch-size", type=int, default=32, help="batch per node (default 32)")
    p.add_argument("--optim", default="adamw", help="inner optimizer name (default adamw)")
    p.add_argument("--lr", type=float, default=1e-3, help="inner learning rate (default 1e-3)")
    p.add_argument("--max-norm", type=float, default=None, help="clip gradients to this norm")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warmup steps")
    p.add_argument("--H", type=int, default=20, help="diloco, fedavg: local steps per round (default 20)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: Nesterov outer learning rate (default 0.7)")
    p.add_argument("--p-sparta", type=float, default=0.005, help="sparta: fraction averaged per step (default 0.005)")
    p.add_argument("--island-size", type=int, default=None, help="fedavg: average within random islands of this size")
    p.add_argument("--topk", type=int, default=32, help="demo: DCT components sent per chunk (default 32)")
    p.add_argument("--cosine", action="store_true", help="cosine-anneal the LR after warmup")
    p.add_argument("--active-nodes", default=None, choices=["doubling", "halving", "ramp_up", "ramp_down"],
                   help="an elastic compute pool (the DiLoCo paper's schedules)")
    p.add_argument("--failure-rate", type=float, default=0.0,
                   help="each node fails with this probability per step (seeded by --seed)")
    p.add_argument("--downtime", type=int, default=20, help="steps a failed node stays down (default 20)")
    p.add_argument("--val-interval", type=int, default=50)
    p.add_argument("--val-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: the best available)")
    p.add_argument("--log-dir", default="logs", help="where run folders go (default logs/)")
    p.add_argument("--overwrite", action="store_true", help="replace run folders that already hold a run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _fit(args: argparse.Namespace, strategy_name: str, run_name: str | None):
    from exogym import RandomFailures, Trainer
    from exogym.logger import CSVLogger

    model, train, val = get_task(args.task).build()
    strategy = STRATEGY_BUILDERS[strategy_name](args)
    logger = CSVLogger(args.log_dir, run_name)
    trainer = Trainer(model, train, val)
    failures = RandomFailures(args.failure_rate, args.downtime, args.seed) if args.failure_rate else None
    trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=args.batch_size, val_interval=args.val_interval,
                val_size=args.val_size, seed=args.seed, device=args.device, logger=logger, progress=not args.quiet,
                active_nodes=args.active_nodes, failures=failures, overwrite=args.overwrite)
    return trainer.record, logger.run_dir


def _summary_line(name: str, record) -> str:
    val = record.val[-1] if record.val else {}
    acc = f"{val['global_accuracy']:.2%}" if "global_accuracy" in val else "-"
    return (f"| {name:<14} | {val.get('global_loss', float('nan')):9.4f} | {acc:>8} | "
            f"{record.bytes_per_node[0] / 1e6:13.2f} | {record.wall_time_s:7.1f} |")


def cmd_run(args: argparse.Namespace) -> int:
    record, run_dir = _fit(args, args.strategy, args.run_name)
    print(f"\n| {'strategy':<14} | val loss  | accuracy | MB sent/node  | seconds |")
    print(_summary_line(args.strategy, record))
    print(f"\nrun folder: {run_dir}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from exogym.plot import plot_runs

    rows, folders = [], []
    for name in args.strategies:
        record, run_dir = _fit(args, name, f"{args.prefix}{name}-{args.nodes}n")
        rows.append(_summary_line(name, record))
        folders.append(run_dir)
    print(f"\n| {'strategy':<14} | val loss  | accuracy | MB sent/node  | seconds |")
    print(f"|{'-' * 16}|-----------|----------|---------------|---------|")
    print("\n".join(rows))
    out = Path(args.out)
    plot_runs(folders, x="step", y="global_loss", out=out, labels=args.strategies)
    by_bytes = out.with_name(out.stem + "_vs_bytes" + out.suffix)
    plot_runs(folders, x="bytes", y="global_loss", out=by_bytes, labels=args.strategies)
    print(f"\nplots: {out}, {by_bytes}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from exogym.plot import plot_runs

    out = plot_runs(args.runs, x=args.x, y=args.y, out=args.out)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exogym", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train one strategy on a built-in task",
                         description="Train one strategy on a built-in task; writes a run folder under --log-dir.")
    run.add_argument("--strategy", default="ddp", choices=sorted(STRATEGY_BUILDERS))
    run.add_argument("--run-name", default=None, help="run folder name (default: strategy, nodes and time)")
    _add_training_options(run)
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser("compare", help="train several strategies on one task, then a table and plots",
                             description="Train several strategies with the same settings; print a table and "
                                         "save loss-vs-steps and loss-vs-bytes plots.")
    compare.add_argument("--strategies", nargs="+", default=list(STRATEGY_BUILDERS), choices=list(STRATEGY_BUILDERS))
    compare.add_argument("--out", default="comparison.png", help="plot file (default comparison.png)")
    compare.add_argument("--prefix", default="", help="prefix for the run folder names")
    _add_training_options(compare)
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot run folders against each other",
                          description="Draw one column of several run folders against steps, examples, bytes or time.")
    plot.add_argument("runs", nargs="+", help="run folders (logs/<run_name>)")
    plot.add_argument("--x", default="step", choices=["step", "examples", "tokens", "bytes", "wall_time_s", "sim_time_s"])
    plot.add_argument("--y", default="global_loss", help="a column of train.csv or val.csv (default global_loss)")
    plot.add_argument("--out", default="plot.png")
    plot.set_defaults(func=cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
