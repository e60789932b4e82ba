"""The one table of options that `exogym run`, `compare` and `sweep` take (the sweep takes several values of each),
their parsers (each value checked as it is read) and what they become: fit's simulated cluster (network, node
speeds, failures, elastic pool, slowdowns) here, the strategy's knobs in exogym.cli.strategies."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from exogym._validation import MAX_SEED
from exogym.cluster.network import PRESETS
from exogym.cli.tasks import TASKS
from exogym.strategy.gossip import TOPOLOGIES

__all__ = ["Option", "OPTIONS", "add_options", "cluster_arguments", "int_at_least", "number", "text"]


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """A parser of an integer in [minimum, maximum]."""
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        if maximum is not None and n > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {n}")
        return n
    return parse


def number(*, positive: bool = False, below_one: bool = False) -> Callable[[str], float]:
    """A parser of a finite number, >= 0 (> 0 when positive), at most 1 when below_one."""
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {value!r}") from None
        if x in (float("inf"), float("-inf")):  # 1e999 too: a float that large is inf
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if x != x or (positive and x <= 0) or (not positive and x < 0):
            raise argparse.ArgumentTypeError(f"must be {'> 0' if positive else '>= 0'}, got {value}")
        if below_one and x > 1:
            raise argparse.ArgumentTypeError(f"must be at most 1, got {value}")
        return x
    return parse


def text(value: str) -> str:
    """A name or path that must not be empty ("" would silently mean the current folder or the default device)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must not be empty, got {value!r}")
    return value


def _failure_rate(value: str) -> float:
    """A per-step failure probability a run can use: at 1 every node fails at every step, so none trains."""
    x = number(below_one=True)(value)
    if x == 1:
        raise argparse.ArgumentTypeError(f"must be below 1 (at 1 every node fails at every step), got {value}")
    return x


def _factor(value: str) -> float:
    """A slowdown factor: how many times longer compute takes, at least 1 (1: no slowdown)."""
    x = number(positive=True)(value)
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (a factor of 2 halves the node's speed), got {value}")
    return x


def _node_speeds(value: str) -> tuple[float, ...]:
    """One speed for every node (0.5) or one per node, comma-separated (1,1,0.5,0.5)."""
    parts = value.split(",")
    try:
        return tuple(number(positive=True)(p) for p in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"takes speeds > 0, one for every node (0.5) or one per node, "
                                         f"comma-separated (1,1,0.5,0.5); {e}") from None


@dataclass(frozen=True)
class Option:
    """One command-line option: its flag, parser, default and help (argparse.add_argument's words)."""

    flag: str
    help: str
    default: Any = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | None = None
    switch: bool = False  # a flag without a value (store_true)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.switch:
            parser.add_argument(self.flag, action="store_true", help=self.help)
        else:
            parser.add_argument(self.flag, type=self.type, default=self.default, choices=self.choices,
                                help=self.help)


# What every training command takes. The strategies' knobs say which strategies read them; each strategy's builder
# (exogym.cli.strategies) reads only its own, and an option given that no strategy of the command reads is an error.
OPTIONS: tuple[Option, ...] = (
    Option("--task", "; ".join(f"{t.name}: {t.description}" for t in TASKS.values()), "synthetic",
           choices=sorted(TASKS)),
    Option("--nodes", "number of simulated nodes", 4, int_at_least(1)),
    Option("--steps", "optimizer steps per run", 200, int_at_least(1)),
    Option("--batch-size", "batch per node", 32, int_at_least(1)),
    # the inner optimizer and its schedule: every strategy
    Option("--optim", "inner optimizer name (adamw, sgd, adam, ...) (default: adamw; dgc: sgd, its paper's)", None,
           text),
    Option("--lr", "inner learning rate (default: 1e-3; dgc: 0.1, for its SGD)", None, number(positive=True)),
    Option("--max-norm", "clip gradients to this norm (default: none, no clipping)", None, number(positive=True)),
    Option("--warmup-steps", "linear LR warmup steps", 0, int_at_least(0)),
    Option("--cosine", "cosine-anneal the LR after warmup", switch=True),
    # the strategies' knobs
    Option("--H", "local steps per round (diloco, fedavg, streaming-diloco, sparta-diloco, async-diloco, fedbuff, "
                  "decoupled-diloco; gossip: steps between mixes)", 20, int_at_least(1)),
    Option("--outer-lr", "outer learning rate (diloco and its variants: Nesterov)", 0.7, number(positive=True)),
    Option("--p-sparta", "sparta, sparta-diloco: fraction of the parameters averaged per step", 0.005,
           number(positive=True, below_one=True)),
    Option("--island-size", "fedavg: average within random islands of this size (default: none, all nodes)", None,
           int_at_least(1)),
    Option("--topk", "demo: DCT components sent per chunk", 32, int_at_least(1)),
    Option("--sparsity", "dgc: the fraction of the accumulated gradient's entries sent each step", 0.001,
           number(positive=True, below_one=True)),
    Option("--fragments", "streaming-diloco, decoupled-diloco: the model's fragments, synchronised in turn "
                          "(default: streaming-diloco 2, decoupled-diloco 1)", None, int_at_least(1)),
    Option("--buffer-size", "fedbuff: pseudo-gradients the server buffers per update", 2, int_at_least(1)),
    Option("--server-lr", "fedbuff: the server's learning rate", 1.0, number(positive=True)),
    Option("--topology", "gossip: who mixes with whom", "ring", choices=list(TOPOLOGIES)),
    Option("--gossip-mode", "gossip: sync (every node mixes at once) or async (each on its own clock)", "sync",
           choices=["sync", "async"]),
    Option("--time-budget", "async-diloco, fedbuff, decoupled-diloco, gossip --gossip-mode async: a node sits out "
                            "its remaining steps once its clock (simulated seconds with a --network, else the run's "
                            "seconds) reaches this (default: none, every node trains every step)", None,
           number(positive=True)),
    # the simulated cluster
    Option("--network", "simulated network: gives the run simulated time (default: none, no simulated time)",
           choices=sorted(PRESETS)),
    Option("--node-speeds", "each node's compute speed, one for all (0.5) or one per node (1,1,0.5,0.5); turns "
                            "simulated time on (default: none, all 1)", None, _node_speeds),
    Option("--active-nodes", "an elastic compute pool, the DiLoCo paper's schedules (default: none, every node "
                             "every step)", choices=["doubling", "halving", "ramp_up", "ramp_down"]),
    Option("--failure-rate", "each node fails with this probability per step (seeded by --seed)", 0.0,
           _failure_rate),
    Option("--downtime", "steps a failed node stays down", 20, int_at_least(1)),
    Option("--slowdown-rate", "transient slowdowns per node per simulated second, drawn from --seed (default 0: "
                              "none; turns simulated time on, steps costed at 1e12 FLOP/s per node)", 0.0, number()),
    Option("--slowdown-factor", "how many times longer a slowed node's compute takes", 2.0, _factor),
    Option("--slowdown-duration", "how long a slowdown lasts, in simulated seconds", 10.0, number(positive=True)),
    # validation, seed, device, output
    Option("--val-interval", "validate every this many steps (default: steps/20, so a curve has 21 points from "
                             "step 0)", None, int_at_least(1)),
    Option("--val-size", "validation examples", 512, int_at_least(1)),
    Option("--seed", "seed of data order, nodes and failures", 0, int_at_least(0, MAX_SEED)),
    Option("--device", "cpu, cuda, cuda:1, mps (default: the best available)", None, text),
    Option("--log-dir", "where run folders go", "logs", text),
    Option("--overwrite", "replace run folders that already hold a run (without it, an existing folder stops the "
                          "command)", switch=True),
    Option("--quiet", "no progress bar", switch=True),
)


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add every option of the table to a training command's parser."""
    for option in OPTIONS:
        option.add_to(parser)


def cluster_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """fit's simulated-cluster keywords from the parsed options (network, node_speeds, active_nodes, failures,
    slowdowns): the same for `exogym run`, `compare` and every run of a sweep."""
    from exogym import RandomFailures, RandomSlowdowns

    speeds = args.node_speeds
    if speeds is not None and len(speeds) == 1:
        speeds = speeds * args.nodes  # one speed for every node
    elif speeds is not None and len(speeds) != args.nodes:
        raise ValueError(f"--node-speeds gives {len(speeds)} speeds for --nodes {args.nodes}; give one for every "
                         f"node (0.5) or {args.nodes}, comma-separated")
    return {"network": args.network, "node_speeds": speeds, "active_nodes": args.active_nodes,
            "failures": RandomFailures(args.failure_rate, args.downtime, args.seed) if args.failure_rate else None,
            "slowdowns": (RandomSlowdowns(args.slowdown_rate, args.slowdown_factor, args.slowdown_duration, args.seed)
                          if args.slowdown_rate else None)}
