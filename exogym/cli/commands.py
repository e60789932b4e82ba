"""The `exogym` command: run a strategy on a built-in task, compare several, plot run folders.

    exogym run --task mnist --strategy ddp --nodes 4 --steps 200
    exogym compare --task synthetic --strategies ddp diloco sparta --nodes 4 --steps 100 --out compare.png
    exogym plot logs/run-a logs/run-b --x bytes --y global_loss --out loss_vs_bytes.png
    exogym data mnist --torchvision-root data
    exogym sweep --task synthetic --strategies diloco --H 10 30 --outer-lr 0.5 0.7 --seeds 0 1 --out sweeps/h
    exogym ui runs/ --port 8765
    exogym trace runs/mnist-diloco -o trace.json
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from exogym._validation import MAX_SEED
from exogym.launch.signals import interrupt_signal
from exogym.runs.folder import check_run_name
from exogym.runs.plot import X_AXES
from exogym.strategy import Strategy
from exogym.strategy.optim import OptimSpec
from exogym.cli.tasks import TASKS, get_task

__all__ = ["main", "STRATEGY_BUILDERS", "UsageError"]


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


# Exit statuses: 2 for what the user asked for (refused before anything ran), 1 for a run that started and failed
# (or an error of exogym's own); a run stopped by a signal exits as shells report one: 128 + its number (Ctrl-C:
# 130, SIGTERM: 143).
EXIT_USAGE, EXIT_FAILED = 2, 1


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


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    return parse


def _number(*, positive: bool = False, below_one: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if value in (float("inf"), float("-inf")):  # 1e999 too: a float that large is inf
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value != value or (positive and value <= 0) or (not positive and value < 0):
            raise argparse.ArgumentTypeError(f"must be {'> 0' if positive else '>= 0'}, got {text}")
        if below_one and value > 1:
            raise argparse.ArgumentTypeError(f"must be at most 1, got {text}")
        return value
    return parse


def _failure_rate(text: str) -> float:
    """A per-step failure probability a run can use: at 1 every node fails at every step, so none trains."""
    value = _number(below_one=True)(text)
    if value == 1:
        raise argparse.ArgumentTypeError(f"must be below 1 (at 1 every node fails at every step), got {text}")
    return value


def _factor(text: str) -> float:
    """A slowdown factor: how many times longer compute takes, at least 1 (1: no slowdown)."""
    value = _number(positive=True)(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (a factor of 2 halves the node's speed), got {text}")
    return value


def _text(text: str) -> str:
    """A name or path that must not be empty ("" would silently mean the current folder or the default device)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}")
    return text


def _add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="synthetic", choices=sorted(TASKS),
                   help="; ".join(f"{t.name}: {t.description}" for t in TASKS.values()))
    p.add_argument("--nodes", type=_int_at_least(1), default=4, help="number of simulated nodes")
    p.add_argument("--steps", type=_int_at_least(1), default=200, help="optimizer steps per run")
    p.add_argument("--batch-size", type=_int_at_least(1), default=32, help="batch per node")
    p.add_argument("--optim", default="adamw", help="inner optimizer name (adamw, sgd, adam, ...)")
    p.add_argument("--lr", type=_number(positive=True), default=1e-3, help="inner learning rate")
    p.add_argument("--max-norm", type=_number(positive=True), default=None,
                   help="clip gradients to this norm (default: none, no clipping)")
    p.add_argument("--warmup-steps", type=_int_at_least(0), default=0, help="linear LR warmup steps")
    p.add_argument("--H", type=_int_at_least(1), default=20, help="diloco, fedavg: local steps per round")
    p.add_argument("--outer-lr", type=_number(positive=True), default=0.7, help="diloco: Nesterov outer learning rate")
    p.add_argument("--p-sparta", type=_number(positive=True, below_one=True), default=0.005,
                   help="sparta: fraction of the parameters averaged per step")
    p.add_argument("--island-size", type=_int_at_least(1), default=None,
                   help="fedavg: average within random islands of this size (default: none, all nodes)")
    p.add_argument("--topk", type=_int_at_least(1), default=32, help="demo: DCT components sent per chunk")
    p.add_argument("--cosine", action="store_true", help="cosine-anneal the LR after warmup")
    p.add_argument("--active-nodes", default=None, choices=["doubling", "halving", "ramp_up", "ramp_down"],
                   help="an elastic compute pool, the DiLoCo paper's schedules (default: none, every node every step)")
    p.add_argument("--failure-rate", type=_failure_rate, default=0.0,
                   help="each node fails with this probability per step (seeded by --seed)")
    p.add_argument("--downtime", type=_int_at_least(1), default=20, help="steps a failed node stays down")
    p.add_argument("--slowdown-rate", type=_number(), default=0.0,
                   help="transient slowdowns per node per simulated second, drawn from --seed (default 0: none; turns "
                        "simulated time on, steps costed at 1e12 FLOP/s per node)")
    p.add_argument("--slowdown-factor", type=_factor, default=2.0,
                   help="how many times longer a slowed node's compute takes")
    p.add_argument("--slowdown-duration", type=_number(positive=True), default=10.0,
                   help="how long a slowdown lasts, in simulated seconds")
    p.add_argument("--val-interval", type=_int_at_least(1), default=None,
                   help="validate every this many steps (default: steps/20, so a curve has 21 points from step 0)")
    p.add_argument("--val-size", type=_int_at_least(1), default=512, help="validation examples")
    p.add_argument("--seed", type=_int_at_least(0, MAX_SEED), default=0, help="seed of data order, nodes and failures")
    p.add_argument("--device", type=_text, default=None, help="cpu, cuda, cuda:1, mps (default: the best available)")
    p.add_argument("--log-dir", type=_text, default="logs", help="where run folders go")
    p.add_argument("--overwrite", action="store_true",
                   help="replace run folders that already hold a run (without it, an existing folder stops the command)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _fit(args: argparse.Namespace, strategy_name: str, run_name: str | None):
    from exogym import RandomFailures, RandomSlowdowns, Trainer
    from exogym.runs.loggers import CSVLogger

    strategy = STRATEGY_BUILDERS[strategy_name](args)  # before the data: a bad setting fails at once
    try:
        model, train, val = get_task(args.task).build()
    except RuntimeError as e:  # the loaders' own messages: data not there, no network, a bad hash; each says the fix
        raise UsageError(f"could not load the {args.task} data: {e}") from e
    if val is not None and args.val_size > len(val):
        raise UsageError(f"--val-size {args.val_size} is more than the {len(val):,} validation examples of the "
                         f"{args.task} task; use --val-size {len(val)} or less")
    logger = CSVLogger(args.log_dir, run_name)
    trainer = Trainer(model, train, val)
    failures = RandomFailures(args.failure_rate, args.downtime, args.seed) if args.failure_rate else None
    slowdowns = (RandomSlowdowns(args.slowdown_rate, args.slowdown_factor, args.slowdown_duration, args.seed)
                 if args.slowdown_rate else None)
    val_interval = args.val_interval or max(1, args.steps // 20)
    if not args.quiet:
        print(f"exogym {args.command}: {strategy_name}" + (f" -> {Path(args.log_dir) / run_name}" if run_name else ""),
              flush=True)
    trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=args.batch_size, val_interval=val_interval,
                val_size=args.val_size, seed=args.seed, device=args.device, logger=logger, progress=not args.quiet,
                active_nodes=args.active_nodes, failures=failures, slowdowns=slowdowns, overwrite=args.overwrite)
    return trainer.record, logger.run_dir


def _table(rows: list[tuple[str, object]]) -> str:
    """A Markdown table (header, the |---| row, one row per run) of the runs' final numbers."""
    lines = ["| run | val loss | accuracy | MB sent per node | seconds |", "|---|---:|---:|---:|---:|"]
    for name, record in rows:
        val = record.val[-1] if record.val else {}
        acc = f"{val['global_accuracy']:.2%}" if "global_accuracy" in val else "-"
        loss = f"{val['global_loss']:.4f}" if "global_loss" in val else "-"
        lines.append(f"| {name} | {loss} | {acc} | {record.bytes_per_node[0] / 1e6:.2f} | {record.wall_time_s:.1f} |")
    return "\n".join(lines)


def cmd_run(args: argparse.Namespace) -> int:
    if args.run_name is not None:  # "" too: it is not a name, and never means the default
        check_run_name(args.run_name)
    record, run_dir = _fit(args, args.strategy, args.run_name)
    print("\n" + _table([(args.strategy, record)]))
    print(f"\nrun folder: {run_dir}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from exogym.runs.plot import plot_runs

    names = list(dict.fromkeys(args.strategies))
    if len(names) != len(args.strategies):
        raise UsageError(f"--strategies names one strategy twice ({' '.join(args.strategies)}); name each once")
    runs = {name: f"{args.prefix}{name}" for name in names}
    for run_name in runs.values():
        try:
            check_run_name(run_name)
        except ValueError as e:
            raise UsageError(f"--prefix {args.prefix!r} makes the run name {run_name!r}: {e}") from None
    for name in names:  # every strategy's settings, also against --nodes, before the first run starts
        STRATEGY_BUILDERS[name](args).check_nodes(args.nodes)
    out = Path(args.out)
    by_bytes = out.with_name(out.stem + "_vs_bytes" + out.suffix)
    rows, folders = [], []
    for name, run_name in runs.items():
        record, run_dir = _fit(args, name, run_name)
        rows.append((run_name, record))
        folders.append(run_dir)
    print("\n" + _table(rows))
    labels = [run_name for run_name, _ in rows]
    plot_runs(folders, x="step", y="global_loss", out=out, labels=labels)
    plot_runs(folders, x="bytes", y="global_loss", out=by_bytes, labels=labels)
    print(f"\nrun folders: {', '.join(map(str, folders))}\nplots: {out}, {by_bytes}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from exogym.runs.plot import plot_runs

    out = plot_runs(args.runs, x=args.x, y=args.y, out=args.out)
    print(out)
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's layout and shows every option's default (options without one say what
    leaving them out means in their help; flags are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, "") or isinstance(action, (argparse._StoreTrueAction, argparse._HelpAction)):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2 (argparse's own prints the usage too)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="exogym", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="train one strategy on a built-in task", formatter_class=_HelpFormatter,
                         description="Train one strategy on a built-in task; writes a run folder under --log-dir.")
    run.add_argument("--strategy", default="ddp", choices=sorted(STRATEGY_BUILDERS), help="the strategy")
    run.add_argument("--run-name", default=None,
                     help="run folder name; an existing folder is never replaced (default: strategy, nodes and time)")
    _add_training_options(run)
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser("compare", help="train several strategies on one task, then a table and plots",
                             formatter_class=_HelpFormatter,
                             description="Train several strategies with the same settings; print a table and save\n"
                                         "loss-vs-steps and loss-vs-bytes plots. Run folders are\n"
                                         "<log-dir>/<prefix><strategy>; an existing one is never replaced.")
    compare.add_argument("--strategies", nargs="+", default=list(STRATEGY_BUILDERS), choices=list(STRATEGY_BUILDERS),
                         help="the strategies to run, in order")
    compare.add_argument("--out", type=_text, default="comparison.png",
                         help="plot file (and <name>_vs_bytes.png beside it)")
    compare.add_argument("--prefix", default="", help="prefix of the run folder names (default: none)")
    _add_training_options(compare)
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot run folders against each other", formatter_class=_HelpFormatter,
                          description="Draw one column of several run folders against steps, examples, bytes or "
                                      "time; the legend shows the folder names.")
    plot.add_argument("runs", nargs="+", help="run folders (logs/<run_name>)")
    plot.add_argument("--x", default="step", choices=list(X_AXES), help="the x axis")
    plot.add_argument("--y", default="global_loss", help="a column of train.csv or val.csv")
    plot.add_argument("--out", type=_text, default="plot.png", help="the PNG to write")
    plot.set_defaults(func=cmd_plot)

    from exogym.cli.data import add_data_command
    add_data_command(sub, formatter_class=_HelpFormatter)

    from exogym.cli.ui import add_ui_commands
    add_ui_commands(sub, formatter_class=_HelpFormatter)

    from exogym.cli.sweep import add_sweep_command  # its own module; it is given the options and builders here
    add_sweep_command(sub, formatter_class=_HelpFormatter, training_options=_add_training_options,
                      builders=STRATEGY_BUILDERS)
    return parser


# Raised by exogym's own checks of what a user passed, before anything runs: one line, status 2.
_USER_ERRORS = (UsageError, ValueError, TypeError, KeyError, OSError, ImportError)


def _one_line(e: BaseException) -> str:
    """The exception's message and its notes (which name the node and step it was raised in), on one line."""
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return " ".join(" ".join([str(text), *getattr(e, "__notes__", ())]).split())


def _report(args: argparse.Namespace, e: BaseException) -> int:
    """One line on stderr for an exception that ended the command, and the exit status it gives."""
    # Trainer.fit sets run_folder (None: the run gave its folder back) and record on what escapes a run that started.
    folder = getattr(e, "run_folder", None)
    started = hasattr(e, "run_folder") or hasattr(e, "record") or \
        any("raised in node" in n for n in getattr(e, "__notes__", ()))
    if isinstance(e, KeyboardInterrupt):  # Ctrl-C, or fit's RunInterrupted (SIGTERM), which names its signal
        name = interrupt_signal(e).name
        text = _one_line(e)
        line = f"interrupted ({'Ctrl-C' if name == 'SIGINT' else name}){': ' + text if text else ''}"
        status = 128 + int(getattr(signal, str(name), signal.SIGINT))
    elif started:
        line, status = f"error: the run failed: {type(e).__name__}: {_one_line(e)}", EXIT_FAILED
    elif isinstance(e, _USER_ERRORS):
        line, status = f"error: {_one_line(e)}", EXIT_USAGE
    else:
        line, status = f"internal error: {type(e).__name__}: {_one_line(e)}; please report it", EXIT_FAILED
    if folder is not None and str(folder) not in line:
        line += f"; run folder: {folder}"
    elif started and folder is None and hasattr(e, "run_folder"):
        line += "; no run folder was kept (the run stopped before its first row was written)"
    print(f"exogym {args.command}: {line} (--debug for the traceback)", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; any error is one line on stderr and an exit status (2: refused before anything ran, 1: a run
    that failed, 128 + the signal: interrupted, 130 for Ctrl-C), with the traceback only under --debug."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        if args.debug:
            raise
        return _report(args, e)

