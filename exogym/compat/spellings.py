"""The original EXO Gym's spellings, mapped to this library's in one place.

Scripts written for the original (its documents and the exo-explore/gym repository) call things by
other names: `inner_optim_spec=` for `optim_spec=`, `fit(num_epochs, strategy, num_nodes, ...)` with
positional arguments, `correlation_interval=` for `diagnostics_interval=`, and so on. Each alias here is
renamed to the canonical keyword before anything is built, so the objects, config.json and error
messages only ever see the canonical spelling. docs/coming_from_exogym.md lists them all.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Mapping

from exogym._validation import caller_level, init_keywords
from exogym.adapters import register_adapter

__all__ = ["KEYWORD_ALIASES", "IGNORED_STRATEGY_KEYWORDS", "canonical_keywords", "caller_level", "install"]

# Constructor keywords: original spelling -> canonical keyword. Applied to a class only when the class
# takes the canonical keyword and does not itself take the original one.
KEYWORD_ALIASES: Mapping[str, str] = {
    "inner_optim_spec": "optim_spec",          # FedAvgStrategy, SPARTADiLoCoStrategy in the original repository
    "async_sparta_delay": "async_delay",       # SPARTAStrategy in the original repository
    "sparsification_rate": "p_sparta",         # SparseCommunicator in the long README
    "optimizer_class": "cls",                  # OptimSpec(optimizer_class=...) in the strategies API reference
    "experiment_name": "run_name",             # WandbLogger(experiment_name=...) in the long README
    "index_selector": "p_sparta",              # SparseCommunicator(index_selector=...) in the original repository
}

# Keywords the original's base Strategy turned into unused attributes, and its own example/mnist.py passes to
# every strategy in one loop (H to DDP and SPARTA, p to all three). Accepted with a warning where a built-in strategy
# has no such knob, so that script runs, and listed apart as ignored in config.json; any other unknown keyword is
# still a TypeError there. A strategy of your own keeps them as attributes (exogym.strategy.base.Strategy).
IGNORED_STRATEGY_KEYWORDS = ("H", "p")



@functools.lru_cache(maxsize=None)
def _accepted(cls: type) -> frozenset[str]:
    return frozenset(init_keywords(cls))


def canonical_keywords(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """kwargs with every original spelling that `cls` understands renamed to its canonical keyword."""
    accepted = _accepted(cls)
    out = dict(kwargs)
    for alias, canonical in KEYWORD_ALIASES.items():
        if alias in out and alias not in accepted and canonical in accepted:
            if canonical in out:
                raise TypeError(f"{cls.__name__} got both {alias}= and {canonical}=; {alias} is the original EXO "
                                f"Gym's name for {canonical}, pass one of them")
            out[canonical] = out.pop(alias)
    return out


_NAMED_SCHEDULES = {"cosine": True, "constant": False}  # lambda_cosine with cosine_anneal: cosine decay / constant


def named_schedule(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """lr_scheduler="cosine" / "constant" (the original documents') -> "lambda_cosine" with cosine_anneal."""
    name = kwargs.get("lr_scheduler")
    if not isinstance(name, str) or name not in _NAMED_SCHEDULES:
        return args, kwargs
    anneal = _NAMED_SCHEDULES[name]
    nested = dict(kwargs.get("lr_scheduler_kwargs") or {})
    for given in (kwargs.get("cosine_anneal"), nested.get("cosine_anneal")):
        if given is not None and given != anneal:
            raise ValueError(f"lr_scheduler={name!r} means cosine_anneal={anneal}, got cosine_anneal={given!r}; "
                             "use lr_scheduler='lambda_cosine' and set cosine_anneal yourself")
    out = {**kwargs, "lr_scheduler": "lambda_cosine"}
    if "cosine_anneal" in nested:
        out["lr_scheduler_kwargs"] = nested
    else:
        out["cosine_anneal"] = anneal
    return args, out


def demo_from_torch_spec(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """DeMoStrategy(optim_spec=OptimSpec(torch.optim.AdamW, lr=..., weight_decay=...)) (the original's scripts):
    the spec's lr and weight_decay become DeMo's; DeMo has no other optimizer setting to take from it."""
    from exogym.strategy.demo import DeMo
    from exogym.strategy.optim import OptimSpec

    args, kwargs = named_schedule(args, kwargs)
    if args and "optim_spec" not in kwargs:
        args, kwargs = args[1:], {**kwargs, "optim_spec": args[0]}
    spec = kwargs.get("optim_spec")
    if not isinstance(spec, OptimSpec) or issubclass(spec.cls, DeMo):
        return args, kwargs
    other = sorted(set(spec.kwargs) - {"lr", "weight_decay"})
    if other:
        raise TypeError(f"DeMoStrategy takes lr and weight_decay from optim_spec={spec!r}, but DeMo has no {other} "
                        "(its momentum is compression_decay, its update a sign); drop them, or pass "
                        "OptimSpec(exogym.strategy.demo.DeMo, ...)")
    out = {k: v for k, v in kwargs.items() if k != "optim_spec"}
    for name, value in spec.kwargs.items():
        if out.get(name) is not None and out[name] != value:
            raise TypeError(f"DeMoStrategy got {name}={out[name]!r} and optim_spec={spec!r} with {name}={value!r}; "
                            "pass one of them")
        out[name] = value
    return args, out


def pop_ignored_strategy_keywords(cls: type, kwargs: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """Take out of `kwargs` (with a warning) the keywords the original accepted on every strategy and ignored, where
    `cls`, a built-in strategy, has no such knob; return them, {name: (value, why)}: the constructor never sees them
    and the run's config.json lists them under "ignored". A strategy of your own gets them (Strategy.__init__ keeps
    them as attributes), and your own composition (CommunicateOptimizeStrategy) rejects them: there H= or p= was
    meant for a module, a TypeError, not a warning."""
    from exogym.strategy.communicate_optimize_strategy import CommunicateOptimizeStrategy

    if cls.__module__.split(".")[0] != "exogym" or issubclass(cls, CommunicateOptimizeStrategy):
        return {}
    owner = cls.__name__
    accepted = _accepted(cls)
    ignored = {k: kwargs.pop(k) for k in IGNORED_STRATEGY_KEYWORDS if k in kwargs and k not in accepted}
    if ignored:
        shown = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        warnings.warn(f"{owner} has no {' or '.join(ignored)}, so {shown} has no effect (the original EXO Gym accepted "
                      "and ignored it too); drop it to silence this warning", UserWarning, stacklevel=caller_level())
    why = "(the original EXO Gym accepted and ignored it too)"
    return {k: (v, f"{owner} has no {k} {why}") for k, v in ignored.items()}


def _respelled(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, canonical_keywords(cls, kwargs)


def _strategy(cls: type, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, tuple[Any, str]]]:
    kwargs = dict(kwargs)
    ignored = pop_ignored_strategy_keywords(cls, kwargs)
    return (*named_schedule(args, kwargs), ignored)


def install() -> None:
    """Register the spellings with the core's argument hooks (exogym.adapters)."""
    from exogym.runs.loggers import Logger
    from exogym.strategy.base import Strategy
    from exogym.strategy.communicate_optimize_strategy import CommunicationModule
    from exogym.strategy.demo import DeMoStrategy
    from exogym.strategy.optim import OptimSpec

    for cls in (Strategy, OptimSpec, Logger, CommunicationModule):
        register_adapter(cls, _respelled)
    register_adapter(Strategy, _strategy)
    register_adapter(DeMoStrategy, lambda cls, args, kwargs: demo_from_torch_spec(args, kwargs))
