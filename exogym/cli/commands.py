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
from typing import NoReturn, Sequence

from exogym.cli.options import OPTIONS, add_options, cluster_arguments, text
from exogym.cli.strategies import STRATEGY_BUILDERS, options_read
from exogym.cli.tasks import get_task
from exogym.launch.signals import interrupt_signal
from exogym.runs.folder import check_run_name
from exogym.runs.plot import X_AXES

__all__ = ["main", "STRATEGY_BUILDERS", "UsageError"]


class UsageError(Exception):
    """A mistake in what the user asked for: printed as one line, exit status 2."""


# Exit statuses: 2 for what the user asked for (refused before anything ran), 1 for a run that started and failed
# (or an error of exogym's own); a run stopped by a signal exits as shells report one: 128 + its number (Ctrl-C:
# 130, SIGTERM: 143).
EXIT_USAGE, EXIT_FAILED = 2, 1


def _fit(args: argparse.Namespace, strategy_name: str, run_name: str | None):
    from exogym import Trainer
    from exogym.runs.loggers import CSVLogger

    strategy = STRATEGY_BUILDERS[strategy_name](args)  # before the data: a bad setting fails at once
    cluster = cluster_arguments(args)
    try:
        model, train, val = get_task(args.task).build()
    except RuntimeError as e:  # the loaders' own messages: data not there, no network, a bad hash; each says the fix
        raise UsageError(f"could not load the {args.task} data: {e}") from e
    if val is not None and args.val_size > len(val):
        raise UsageError(f"--val-size {args.val_size} is more than the {len(val):,} validation examples of the "
                         f"{args.task} task; use --val-size {len(val)} or less")
    logger = CSVLogger(args.log_dir, run_name)
    trainer = Trainer(model, train, val)
    val_interval = args.val_interval or max(1, args.steps // 20)
    if not args.quiet:
        print(f"exogym {args.command}: {strategy_name}" + (f" -> {Path(args.log_dir) / run_name}" if run_name else ""),
              flush=True)
    trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=args.batch_size, val_interval=val_interval,
                val_size=args.val_size, seed=args.seed, device=args.device, logger=logger, progress=not args.quiet,
                overwrite=args.overwrite, **cluster)
    return trainer.record, logger.run_dir


# What `exogym compare` runs when --strategies is left out: one of each family, seconds each on the synthetic task.
COMPARED = ("ddp", "diloco", "sparta", "fedavg", "demo")


def _check_read(args: argparse.Namespace, strategies: list[str]) -> None:
    """An option given (not at its default) that none of the command's strategies reads is an error: it would
    change nothing."""
    read = set().union(*(options_read(STRATEGY_BUILDERS[s], vars(args)) for s in strategies))  # their errors first
    every = set().union(*(options_read(b, vars(args), strict=False) for b in STRATEGY_BUILDERS.values()))
    defaults = {o.flag[2:].replace("-", "_"): o.default for o in OPTIONS}
    unread = [f"--{d.replace('_', '-')}" for d in sorted(every - read) if getattr(args, d) != defaults.get(d)]
    if unread:
        raise UsageError(f"{', '.join(unread)}: not an option of {' or '.join(strategies)}, so it would change "
                         "nothing; drop it, or run a strategy that takes it (exogym run --help lists which)")


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
    _check_read(args, [args.strategy])
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
    _check_read(args, names)
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
    add_options(run)
    run.set_defaults(func=cmd_run)

    compare = sub.add_parser("compare", help="train several strategies on one task, then a table and plots",
                             formatter_class=_HelpFormatter,
                             description="Train several strategies with the same settings; print a table and save\n"
                                         "loss-vs-steps and loss-vs-bytes plots. Run folders are\n"
                                         "<log-dir>/<prefix><strategy>; an existing one is never replaced.")
    compare.add_argument("--strategies", nargs="+", default=list(COMPARED), choices=list(STRATEGY_BUILDERS),
                         help="the strategies to run, in order")
    compare.add_argument("--out", type=text, default="comparison.png",
                         help="plot file (and <name>_vs_bytes.png beside it)")
    compare.add_argument("--prefix", default="", help="prefix of the run folder names (default: none)")
    add_options(compare)
    compare.set_defaults(func=cmd_compare)

    plot = sub.add_parser("plot", help="plot run folders against each other", formatter_class=_HelpFormatter,
                          description="Draw one column of several run folders against steps, examples, bytes or "
                                      "time; the legend shows the folder names.")
    plot.add_argument("runs", nargs="+", help="run folders (logs/<run_name>)")
    plot.add_argument("--x", default="step", choices=list(X_AXES), help="the x axis")
    plot.add_argument("--y", default="global_loss", help="a column of train.csv or val.csv")
    plot.add_argument("--out", type=text, default="plot.png", help="the PNG to write")
    plot.set_defaults(func=cmd_plot)

    from exogym.cli.data import add_data_command
    add_data_command(sub, formatter_class=_HelpFormatter)

    from exogym.cli.ui import add_ui_commands
    add_ui_commands(sub, formatter_class=_HelpFormatter)

    from exogym.cli.sweep import add_sweep_command  # its own module; it is given the options and builders here
    add_sweep_command(sub, formatter_class=_HelpFormatter, training_options=add_options,
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

