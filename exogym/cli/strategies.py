"""Every built-in strategy by its command-line name, built from the parsed options (exogym.cli.options): each
builder reads only the options its strategy has, which is how `compare` and `sweep` know an option no strategy of
theirs reads."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from exogym.strategy import Strategy
from exogym.strategy.optim import OptimSpec

__all__ = ["STRATEGY_BUILDERS", "options_read"]


def _lr(args: argparse.Namespace, default: float = 1e-3) -> float:
    return default if args.lr is None else args.lr


def _inner(args: argparse.Namespace, default: str = "adamw", lr: float = 1e-3) -> OptimSpec:
    return OptimSpec.from_string(default if args.optim is None else args.optim, lr=_lr(args, lr))


def _common(args: argparse.Namespace) -> dict:
    out = {"max_norm": args.max_norm}
    if args.warmup_steps:
        out.update(warmup_steps=args.warmup_steps, cosine_anneal=args.cosine)
    return out


def _given(**values: Any) -> dict:
    """The options left out (None) are the strategy's own defaults."""
    return {k: v for k, v in values.items() if v is not None}


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
    optim, settings = args.optim, dict(lr=_lr(args), compression_topk=args.topk, **_common(args))  # every read first
    if optim is not None:
        raise ValueError(f"demo is its own optimizer (DeMo); --optim {optim} does not apply: drop it")
    return DeMoStrategy(**settings)


def _streaming_diloco(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import StreamingDiLoCoStrategy
    # 2 fragments unless told: the synthetic task's MLP has two layers (the strategy's own default, 4, needs four)
    return StreamingDiLoCoStrategy(_inner(args), H=args.H, outer_lr=args.outer_lr,
                                   num_fragments=2 if args.fragments is None else args.fragments, **_common(args))


def _sparta_diloco(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import SPARTADiLoCoStrategy
    return SPARTADiLoCoStrategy(_inner(args), H=args.H, outer_lr=args.outer_lr, p_sparta=args.p_sparta,
                                **_common(args))


def _dgc(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import DGCStrategy
    # SGD at 0.1 unless told: its paper's optimizer; at AdamW's 1e-3 it barely moves in a short run
    return DGCStrategy(_inner(args, "sgd", 0.1), target_sparsity=args.sparsity, **_common(args))


def _async_diloco(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import AsyncDiLoCoStrategy
    return AsyncDiLoCoStrategy(_inner(args), H=args.H, outer_lr=args.outer_lr, time_budget_s=args.time_budget,
                               **_common(args))


def _fedbuff(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import FedBuffStrategy
    return FedBuffStrategy(_inner(args), H=args.H, buffer_size=args.buffer_size, server_lr=args.server_lr,
                           time_budget_s=args.time_budget, **_common(args))


def _decoupled_diloco(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import DecoupledDiLoCoStrategy
    return DecoupledDiLoCoStrategy(_inner(args), H=args.H, outer_lr=args.outer_lr, time_budget_s=args.time_budget,
                                   **_given(fragments=args.fragments), **_common(args))


def _gossip(args: argparse.Namespace) -> Strategy:
    from exogym.strategy import GossipStrategy
    settings = dict(H=args.H, topology=args.topology, mode=args.gossip_mode, time_budget_s=args.time_budget,
                    **_common(args))  # every option read before any check (options_read)
    if settings["time_budget_s"] is not None and settings["mode"] != "async":
        raise ValueError("--time-budget needs --gossip-mode async: in sync gossip a node that stops would leave "
                         "its neighbours waiting for it")
    return GossipStrategy(_inner(args), **settings)


# name -> builder(args): one name per strategy, the names of docs/strategies.md.
STRATEGY_BUILDERS: dict[str, Callable[[argparse.Namespace], Strategy]] = {
    "ddp": _ddp, "diloco": _diloco, "sparta": _sparta, "fedavg": _fedavg, "demo": _demo,
    "streaming-diloco": _streaming_diloco, "sparta-diloco": _sparta_diloco, "dgc": _dgc,
    "async-diloco": _async_diloco, "fedbuff": _fedbuff, "decoupled-diloco": _decoupled_diloco, "gossip": _gossip}


class _Reads(argparse.Namespace):
    """A namespace that notes which options a strategy builder reads."""

    def __init__(self, values: dict[str, Any]):
        super().__init__(**values)
        object.__setattr__(self, "_read", set())

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "_read").add(name)
        return object.__getattribute__(self, name)


def options_read(builder: Callable[[argparse.Namespace], Any], values: dict[str, Any], *,
                 strict: bool = True) -> set[str]:
    """The options (dests) a strategy's builder reads, given these values (it is called once). strict=False: a
    builder refusing the values still says what it read (each reads all its options before it checks any)."""
    ns = _Reads(values)
    try:
        builder(ns)
    except Exception:  # noqa: BLE001 - not strict: probing a strategy the command does not run
        if strict:
            raise
    return set(object.__getattribute__(ns, "_read"))
