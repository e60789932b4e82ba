"""`exogym sweep`: a grid or a search over the built-in tasks' settings (exogym.sweep from the command line).

    exogym sweep --task shakespeare --strategies diloco --nodes 2 4 8 --H 10 30 100 --outer-lr 0.3 0.5 0.7 \\
        --seeds 0 1 2 --steps 450 --workers 2 --out sweeps/scaling
    exogym sweep --resume sweeps/scaling
    exogym sweep --task mnist --strategies diloco --search tpe --trials 40 --H 5:200:log --outer-lr 0.1:1.0 \\
        --objective val_loss --budget-bytes 5MB --out sweeps/mnist-tpe

Every option of `exogym run` that takes a value takes several here (a grid's values) or, for a number,
low:high or low:high:log (a search's range); each value is checked as `exogym run` checks it. An option given
one value is fixed. With several strategies, each runs with the options it reads (DDP ignores --outer-lr, so its
configurations are not repeated per outer lr); an option no strategy of the sweep reads is an error.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from exogym._validation import MAX_SEED, check_int
from exogym.fit.nodes import check_node_memory
from exogym.sweep.objective import metric_name, parse_bytes
from exogym.sweep.space import Choice, Float, Int, Space, space
from exogym.sweep.storage import StorageUnavailable, SweepStopped
from exogym.sweep.sweep import SEARCHES, read_definition, sweep
from exogym.cli.options import cluster_arguments
from exogym.cli.strategies import options_read
from exogym.cli.tasks import TASKS, get_task

__all__ = ["add_sweep_command", "TaskRun"]

# Options of `exogym run` that are not parameters of a sweep: what to run, where, and how it prints.
_NOT_SWEPT = {"help", "task", "seed", "device", "log_dir", "overwrite", "quiet", "run_name", "strategy"}
# May accompany --resume: how this process takes part, not what the sweep is.
_RESUME_OPTIONS = {"workers", "retry_failed", "trials", "quiet", "resume", "command", "func", "debug",
                   "sweep_command", "storage_patience"}


@dataclass
class TaskRun:
    """Runs one configuration on a built-in task: the strategy from exogym run's builders, fit with the task's
    data. Picklable (module level), so worker processes can run it; the task's data is loaded once per process."""

    task: str
    fixed: dict[str, Any]  # every option's value, but the configuration's
    builders: dict[str, Callable[[argparse.Namespace], Any]] = field(repr=False)

    def __call__(self, config: dict[str, Any], run: Any) -> Any:
        from exogym import Trainer

        args = argparse.Namespace(**{**self.fixed, **config})
        strategy = self.builders[args.strategy](args)
        model, train, val = _task_data(self.task)
        trainer = Trainer(model, train, val)
        trainer.fit(strategy, args.nodes, max_steps=args.steps, batch_size=args.batch_size,
                    val_interval=args.val_interval or max(1, args.steps // 20), val_size=args.val_size, seed=args.seed,
                    device=args.device, **cluster_arguments(args), **run.fit_kwargs)
        return trainer.record


_TASK_DATA: dict[str, Any] = {}


def _task_data(task: str) -> Any:
    """The task's model and data, built once per process (fit never changes the model it is given)."""
    if task not in _TASK_DATA:
        try:
            _TASK_DATA[task] = get_task(task).build()
        except RuntimeError as e:  # the loaders' own messages say the fix
            raise ValueError(f"could not load the {task} data: {e}") from e
    return _TASK_DATA[task]


def _sweepable(training_options: Callable[[argparse.ArgumentParser], None]) -> list[argparse.Action]:
    probe = argparse.ArgumentParser(add_help=False)
    training_options(probe)
    return [a for a in probe._actions if a.dest not in _NOT_SWEPT and a.nargs != 0]


def add_sweep_command(sub: Any, *, formatter_class: type, training_options: Callable[[argparse.ArgumentParser], None],
                      builders: dict[str, Callable[[argparse.Namespace], Any]]) -> None:
    """Register `exogym sweep` (commands.py passes its training options and strategy builders, which it owns)."""
    p = sub.add_parser("sweep", help="a grid or a search over settings, each configuration over seeds",
                       formatter_class=formatter_class, description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--task", default="synthetic", choices=sorted(TASKS),
                   help="; ".join(f"{t.name}: {t.description}" for t in TASKS.values()))
    p.add_argument("--strategies", nargs="+", default=["diloco"], choices=list(builders), help="the strategies")
    for action in _sweepable(training_options):
        numeric = action.type is not None and action.choices is None
        how = "several values, or low:high[:log] for a search" if numeric else "several values"
        default = f" (default: {action.default})" if action.default is not None else ""
        p.add_argument(*action.option_strings, dest=action.dest, nargs="+", default=None, metavar="V",
                       help=f"{action.help}; {how}{default}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds every configuration runs with (averaged)")
    p.add_argument("--search", default="grid", choices=SEARCHES,
                   help="grid: every combination; random, tpe: Optuna's samplers for --trials configurations "
                        "(pip install 'exogym[sweep]')")
    p.add_argument("--trials", type=int, default=None, help="configurations a search runs (default: none; --search random or tpe need it)")
    p.add_argument("--objective", default="val_loss",
                   help="a summary metric: val_loss, val_accuracy, train_loss, final_global_<metric>, sim_time_s, ...")
    p.add_argument("--direction", default=None, choices=["minimize", "maximize"],
                   help="default: maximize accuracy, minimize anything else")
    p.add_argument("--budget-bytes", default=None, help="read the objective when a run had sent this many bytes "
                                                        "per node (wire bytes; 5MB, 300KB) (default: none, at the end)")
    p.add_argument("--budget-sim-time", type=float, default=None, help="read the objective at this many simulated "
                                                                       "seconds (needs --network) (default: none)")
    p.add_argument("--max-bytes", default=None, help="a configuration sending more wire bytes per node is infeasible "
                                                     "(default: none, no limit)")
    p.add_argument("--max-sim-time", type=float, default=None, help="a configuration taking longer (simulated s) is "
                                                                    "infeasible (needs --network) (default: none)")
    p.add_argument("--workers", type=int, default=None,
                   help="configurations run at once, each in its own process (default: 1; on --resume the sweep's own)")
    p.add_argument("--checkpoint-interval", type=int, default=None,
                   help="save every run every N steps, so an interrupted run resumes where it was (default: none)")
    p.add_argument("--storage", default=None,
                   help="the Optuna study's database URL, postgresql://user@host/db for several machines (pip install "
                        "'exogym[postgres]'); each machine runs the same command with its own --out (default: a "
                        "journal file in the sweep folder)")
    p.add_argument("--study-name", default=None, help="the study's name in --storage (default: the --out folder's name)")
    p.add_argument("--storage-patience", type=float, default=600.0,
                   help="seconds a worker retries an unreachable storage, with backoff, before it gives up")
    p.add_argument("--out", default=None, help="the sweep folder, never written over (default: none; a new sweep needs it)")
    p.add_argument("--resume", default=None, metavar="FOLDER",
                   help="continue (or join) the sweep in FOLDER with its own settings; finished configurations "
                        "are not rerun (default: none, a new sweep)")
    p.add_argument("--retry-failed", action="store_true", help="with --resume: run failed and diverged ones again")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the full traceback of any error (as exogym --debug sweep)")
    p.set_defaults(func=lambda args: cmd_sweep(args, p, training_options, builders))
    commands = p.add_subparsers(dest="sweep_command", metavar="dashboard", parser_class=type(p),
                                description="`exogym sweep dashboard FOLDER|URL` serves a sweep's study; without it, "
                                            "`exogym sweep` starts or resumes a sweep")
    dashboard = commands.add_parser("dashboard", help="serve a sweep's study with optuna-dashboard",
                                    formatter_class=formatter_class,
                                    description="Serve the Optuna study of a sweep (its folder, or its --storage URL) "
                                                "with optuna-dashboard (pip install 'exogym[sweep]').")
    dashboard.add_argument("source", metavar="FOLDER|URL", help="the sweep folder, or its storage URL")
    dashboard.add_argument("--port", type=int, default=8080, help="the port to serve on")
    dashboard.add_argument("--host", default="127.0.0.1", help="the address to serve on")
    dashboard.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    """`exogym sweep dashboard FOLDER|URL`: serve the sweep's study until Ctrl-C."""
    from exogym.sweep.dashboard import serve
    return serve(args.source, host=args.host, port=args.port)


def _values(action: argparse.Action, texts: Sequence[str]) -> Any:
    """An option's values: one (fixed), a list (a grid's axis), or low:high[:log] (a search's range)."""
    parse = action.type or str
    flag = action.option_strings[0]

    def one(text: str) -> Any:
        try:
            value = parse(text)
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"{flag}: {e}") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"{flag}: {text!r} is not one of {sorted(action.choices)}")
        return value

    if len(texts) == 1 and ":" in texts[0]:
        parts = texts[0].split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "log") or action.type is None:
            raise ValueError(f"{flag}: a range is low:high or low:high:log for a number option, got {texts[0]!r}")
        low, high = one(parts[0]), one(parts[1])
        if not all(isinstance(v, (int, float)) for v in (low, high)):
            raise ValueError(f"{flag}: a range is low:high or low:high:log for a number option, got {texts[0]!r}")
        kind = Int if isinstance(low, int) and isinstance(high, int) else Float
        return kind(low, high, log=len(parts) == 3)
    values = [one(t) for t in texts]
    return values[0] if len(values) == 1 else Choice(tuple(values))


def _build(args: argparse.Namespace, training_options: Callable, builders: dict) -> tuple[TaskRun, Space, dict]:
    """The run function, the space and the flags of each parameter, from the parsed options; every check here."""
    actions = {a.dest: a for a in _sweepable(training_options)}
    defaults = {a.dest: a.default for a in actions.values()} | {"device": None, "seed": 0}
    fixed, swept = dict(defaults), {}
    for dest, action in actions.items():
        texts = getattr(args, dest)
        if texts is not None:
            value = _values(action, texts)
            (swept.__setitem__(dest, value) if isinstance(value, (Int, Float, Choice)) else
             fixed.__setitem__(dest, value))
    strategies = list(dict.fromkeys(args.strategies))
    if len(strategies) != len(args.strategies):
        raise ValueError(f"--strategies names one strategy twice ({' '.join(args.strategies)}); name each once")
    # Which options each strategy reads (its builder, called once); the others are not parameters of its runs.
    strategy_options = {s: options_read(builders[s], {**fixed, "strategy": s}) for s in strategies}
    every_strategy_option = set().union(*(options_read(b, {**fixed}, strict=False) for b in builders.values()))
    unread = [n for n in swept if n in every_strategy_option and not any(n in o for o in strategy_options.values())]
    if unread:
        names = ", ".join(actions[n].option_strings[0] for n in unread)
        raise ValueError(f"{names}: not an option of {' or '.join(strategies)}, so every value would give the same "
                         f"runs; drop it, or add a strategy that takes it (--strategies)")
    parts = []
    for s in strategies:
        part = {"strategy": [s]} if len(strategies) > 1 else {}
        part.update({n: d for n, d in swept.items() if n not in every_strategy_option or n in strategy_options[s]})
        parts.append(part)
    if len(strategies) == 1:
        fixed["strategy"] = strategies[0]
    joined: Space | None = None
    for part in parts:
        one = space(**part, seed=args.seeds)
        joined = one if joined is None else joined + one
    flags = {n: actions[n].option_strings[0] for n in swept if n in actions} | {"strategy": "--strategies"}
    return TaskRun(args.task, fixed, dict(builders)), joined, flags


def _command(args: argparse.Namespace, run: TaskRun, flags: dict[str, str], swept: Sequence[str],
             training_options: Callable) -> list[str]:
    """`exogym sweep` with the task and every fixed option that differs from its default (the rerun command's
    base: the configuration's values, --seeds and --out follow)."""
    parts = ["exogym", "sweep", "--task", run.task]
    if "strategy" not in swept:
        parts += ["--strategies", run.fixed["strategy"]]
    for action in _sweepable(training_options):
        value = run.fixed.get(action.dest)
        if action.dest not in swept and value != action.default and value is not None:
            parts += [action.option_strings[0], str(value)]
    return parts


def _check_model_metric(task: str, objective: str) -> None:
    """An objective naming a metric of the model (val_accuracy: final_global_accuracy) must be one the task's model
    returns: one forward pass on two training examples says which it returns."""
    import torch
    from torch.utils.data import default_collate

    m = re.fullmatch(r"final_(global|local)_(\w+)", metric_name(objective))
    if m is None or m.group(2) == "loss":
        return
    model, train, _ = _task_data(task)
    with torch.no_grad():
        out = model(default_collate([train[0], train[1]]))
    have = sorted(out) if isinstance(out, dict) else ["loss"]
    if m.group(2) not in have:
        raise ValueError(f"--objective {objective}: the {task} model returns {', '.join(have)}, not {m.group(2)}; "
                         f"use val_loss, or final_global_<one of those>")


def cmd_sweep(args: argparse.Namespace, parser: argparse.ArgumentParser, training_options: Callable,
              builders: dict) -> int:
    if args.resume is not None:
        given = [k for k, v in vars(args).items() if k not in _RESUME_OPTIONS and v != parser.get_default(k)]
        if given:
            raise ValueError(f"--resume continues the sweep with its own settings; "
                             f"{', '.join('--' + g.replace('_', '-') for g in given)} cannot change them (only "
                             "--workers, --retry-failed, --trials, --storage-patience, --quiet and --debug may be given)")
        stored = read_definition(args.resume).argv
        if stored is None:
            raise ValueError(f"the sweep in {args.resume!r} was started from Python, not by exogym sweep; rerun its "
                             "script with resume=True")
        resumed = parser.parse_args(stored[2:])
        resumed.workers, resumed.retry_failed, resumed.quiet = args.workers, args.retry_failed, args.quiet
        resumed.resume = args.resume
        resumed.trials = args.trials if args.trials is not None else resumed.trials
        return _start(resumed, training_options, builders, resume=True, argv=stored)
    if args.out is None:
        raise ValueError("--out names the sweep folder (e.g. --out sweeps/h-vs-lr); --resume FOLDER continues one")
    if not args.out.strip() or Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out names the sweep folder, got {args.out!r}" + (" (a file)" if args.out.strip() else ""))
    if args.retry_failed:
        raise ValueError("--retry-failed goes with --resume FOLDER (a new sweep has nothing failed yet)")
    return _start(args, training_options, builders, resume=False, argv=_argv_of(args, parser))


def _argv_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The sweep's definition as a command line (what --resume parses again): every option not at its default,
    but those of how this process takes part (--workers, --quiet, ...)."""
    argv = ["exogym", "sweep"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in _RESUME_OPTIONS | {"help"} or not action.option_strings or value == action.default:
            continue
        argv += [action.option_strings[0]] + ([] if value is True else
                                                [str(v) for v in (value if isinstance(value, list) else [value])])
    return argv


def _start(args: argparse.Namespace, training_options: Callable, builders: dict, *, resume: bool,
           argv: list[str]) -> int:
    run, joined, flags = _build(args, training_options, builders)
    needs_time = args.budget_sim_time is not None or args.max_sim_time is not None or args.objective == "sim_time_s"
    if needs_time and not args.network:
        raise ValueError("the objective reads simulated time: give the runs a network (--network low, home, ...)")
    for seed in joined.seeds:
        check_int("--seeds: a seed", seed, minimum=0, maximum=MAX_SEED)
    examples = len(_task_data(args.task)[1])  # the data loads (or says why not) before any trial starts
    for config in _settings_to_check(joined):  # the runs' settings checked before any trial
        values = argparse.Namespace(**{**run.fixed, **config})
        builders[config.get("strategy", run.fixed.get("strategy"))](values).check_nodes(values.nodes)
        check_node_memory(values.nodes)
        if -(-examples // values.nodes) < values.batch_size:  # as fit refuses it: every run of it would fail
            raise ValueError(f"--nodes {values.nodes} --batch-size {values.batch_size}: the {args.task} training data "
                             f"has {examples} examples, fewer than one step needs (nodes x batch size = "
                             f"{values.nodes * values.batch_size}); use fewer nodes or a smaller --batch-size")
    _check_model_metric(args.task, args.objective)
    swept = joined.names
    out = args.resume if resume else args.out
    try:
        _sweep(run, joined, out, args, resume, (_command(args, run, flags, swept, training_options), flags, argv))
    except KeyboardInterrupt:
        return 130  # the sweep said how to resume
    except (StorageUnavailable, SweepStopped) as e:
        if getattr(args, "debug", False):
            raise
        print(f"exogym sweep: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


CHECK_EACH = 10_000  # a grid up to this many configurations has each checked before the sweep starts


def _settings_to_check(joined: Space) -> Iterator[dict]:
    """The configurations whose settings are checked before a grid sweep starts: each of them, for a grid of up to
    CHECK_EACH; for a larger one, every --nodes x --batch-size pair of each part with each value of every other
    option in turn (the others at their first value), so that the check takes a moment whatever the grid's size."""
    if not joined.is_grid:
        return
    if joined.count() <= CHECK_EACH:
        yield from joined.configurations()
        return
    for part in joined.parts:
        first = {n: d.values[0] for n, d in part.items()}
        pairs = [{"nodes": n, "batch_size": b} for n in (part["nodes"].values if "nodes" in part else [None])
                 for b in (part["batch_size"].values if "batch_size" in part else [None])]
        for name, dim in part.items():
            for value in dim.values:
                for pair in pairs:
                    yield {**first, **{k: v for k, v in pair.items() if v is not None}, name: value}


def _sweep(run: TaskRun, joined: Space, out: str, args: argparse.Namespace, resume: bool, command: tuple) -> None:
    sweep(run, joined, out=out, search=args.search, trials=args.trials, objective=args.objective,
          direction=args.direction, budget_bytes=args.budget_bytes and parse_bytes(args.budget_bytes, "--budget-bytes"),
          budget_sim_time=args.budget_sim_time, max_bytes=args.max_bytes and parse_bytes(args.max_bytes, "--max-bytes"),
          max_sim_time=args.max_sim_time, workers=args.workers, resume=resume, retry_failed=args.retry_failed,
          storage=args.storage, study_name=args.study_name, storage_patience=args.storage_patience,
          checkpoint_interval=args.checkpoint_interval, progress=not args.quiet,
          _command=command)
