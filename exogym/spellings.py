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
from pathlib import Path
from typing import Any, Callable, Mapping

from exogym._validation import check_int, init_keywords, reject_unknown_kwargs

__all__ = ["KEYWORD_ALIASES", "IGNORED_STRATEGY_KEYWORDS", "FIT_ALIASES", "ORIGINAL_FIT_ORDER", "Respelled",
           "canonical_keywords", "pop_ignored_strategy_keywords", "fit_arguments"]

# Constructor keywords: original spelling -> canonical keyword. Applied to a class only when the class
# takes the canonical keyword and does not itself take the original one.
KEYWORD_ALIASES: Mapping[str, str] = {
    "inner_optim_spec": "optim_spec",          # FedAvgStrategy, SPARTADiLoCoStrategy in the original repository
    "async_sparta_delay": "async_delay",       # SPARTAStrategy in the original repository
    "sparsification_rate": "p_sparta",         # SparseCommunicator in the long README
    "optimizer_class": "cls",                  # OptimSpec(optimizer_class=...) in the strategies API reference
    "experiment_name": "run_name",             # WandbLogger(experiment_name=...) in the long README
}

# Keywords the original's base Strategy turned into unused attributes, and its own example/mnist.py passes to
# every strategy in one loop (H to DDP and SPARTA, p to all three). Accepted with a warning where the strategy has
# no such knob, so that script runs; any other unknown keyword is still a TypeError.
IGNORED_STRATEGY_KEYWORDS = ("H", "p")

# fit keywords: original spelling -> canonical keyword.
FIT_ALIASES: Mapping[str, str] = {
    "correlation_interval": "diagnostics_interval",
    "kwargs": "extra_config",
}

# The original's fit(num_epochs, strategy, num_nodes, ...) positional order.
ORIGINAL_FIT_ORDER = ("num_epochs", "strategy", "num_nodes", "max_steps", "device", "devices", "batch_size",
                      "minibatch_size", "shuffle", "val_size", "val_interval", "autocast", "checkpoint_interval",
                      "correlation_interval", "save_dir", "dataloader_kwargs")
_FIT_ORDER = ("strategy", "num_nodes")
_ORIGINAL_ONLY = ("save_dir", "wandb_project", "log_x_axis", "gradient_accumulation") + tuple(FIT_ALIASES)


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


class Respelled(type):
    """Metaclass of the public classes that take original spellings: renames them before __new__/__init__ run,
    so the object (and what it records of its arguments, config.json) only sees canonical keywords and values.
    A class may add `_respell(args, kwargs) -> (args, kwargs)` for values spelled the original way."""

    def __call__(cls, /, *args: Any, **kwargs: Any) -> Any:  # positional-only: OptimSpec takes cls=
        kwargs = canonical_keywords(cls, kwargs)
        respell = getattr(cls, "_respell", None)
        if respell is not None:
            args, kwargs = respell(args, kwargs)
        return super().__call__(*args, **kwargs)


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


def pop_ignored_strategy_keywords(cls: type, unknown: dict[str, Any]) -> None:
    """Remove (with a warning) the keywords the original accepted on every strategy and ignored. A class with
    `_original_ignored_keywords = False` (your own composition, CommunicateOptimizeStrategy) rejects them."""
    if not getattr(cls, "_original_ignored_keywords", True):
        return
    owner = cls.__name__
    ignored = {k: unknown.pop(k) for k in IGNORED_STRATEGY_KEYWORDS if k in unknown}
    if ignored:
        shown = ", ".join(f"{k}={v!r}" for k, v in ignored.items())
        warnings.warn(f"{owner} has no {' or '.join(ignored)}, so {shown} has no effect (the original EXO Gym "
                      f"accepted and ignored it too); drop it to silence this warning", UserWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the first frame outside this package (the user's constructor call)."""
    import sys

    package = str(Path(__file__).resolve().parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def fit_arguments(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer.fit's arguments, in either positional order and either spelling, as `target`'s canonical keywords.

    fit(strategy, num_nodes, **options) is this library's order; fit(num_epochs, strategy, num_nodes, max_steps,
    device, ...) the original's (recognised by an int first). Original-only keywords become canonical ones:
    correlation_interval -> diagnostics_interval, kwargs -> extra_config, gradient_accumulation=n ->
    minibatch_size=batch_size // n, save_dir -> checkpoint_dir=<save_dir>/<run_name>, wandb_project (+ log_x_axis)
    -> a WandbLogger next to the other loggers.
    """
    import inspect

    params = inspect.signature(target).parameters
    canonical_names = [p for p in params if params[p].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                   inspect.Parameter.VAR_POSITIONAL)]
    original = bool(args) and isinstance(args[0], int) and not isinstance(args[0], bool)
    order = ORIGINAL_FIT_ORDER if original else _FIT_ORDER
    if len(args) > len(order):
        which = "the original's order fit(num_epochs, strategy, num_nodes, ...)" if original else \
            "fit(strategy, num_nodes, ...)"
        raise TypeError(f"Trainer.fit takes at most {len(order)} positional arguments in {which}, got {len(args)}; "
                        "pass the others by keyword")
    merged = dict(kwargs)
    for name, value in zip(order, args):
        if name in merged:
            raise TypeError(f"Trainer.fit got multiple values for {name!r} (positionally and by keyword)")
        merged[name] = value
    reject_unknown_kwargs("Trainer.fit", {k: v for k, v in merged.items()
                                          if k not in canonical_names and k not in _ORIGINAL_ONLY},
                          canonical_names + list(_ORIGINAL_ONLY))
    for alias, canonical in FIT_ALIASES.items():
        if alias in merged:
            if canonical in merged:
                raise TypeError(f"Trainer.fit got both {alias}= and {canonical}=; {alias} is the original EXO Gym's "
                                f"name for {canonical}, pass one of them")
            merged[canonical] = merged.pop(alias)
    if merged.get("device") == "":
        merged["device"] = None  # the original's "" (its scripts' default): pick the best device available
    _gradient_accumulation(merged, params)
    needs_name = merged.get("save_dir") is not None or merged.get("wandb_project") is not None
    if needs_name and merged.get("run_name") is None and merged.get("strategy") is not None:
        from exogym.logger import default_run_name  # one name for logs/, the checkpoints and the W&B run
        merged["run_name"] = default_run_name({"strategy": type(merged["strategy"]).__name__,
                                               "num_nodes": merged.get("num_nodes", params["num_nodes"].default)})
    _save_dir(merged)
    _wandb(merged)
    return merged


def _gradient_accumulation(merged: dict[str, Any], params: Mapping[str, Any]) -> None:
    steps = merged.pop("gradient_accumulation", None)
    if steps is None:
        return
    check_int("gradient_accumulation", steps, minimum=1)
    if merged.get("minibatch_size") is not None:
        raise TypeError(f"Trainer.fit got both gradient_accumulation={steps} and minibatch_size="
                        f"{merged['minibatch_size']}; gradient_accumulation=n means minibatch_size=batch_size // n, "
                        "pass one of them")
    batch_size = merged.get("batch_size", params["batch_size"].default)
    check_int("batch_size", batch_size, minimum=1)
    if batch_size % steps:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"gradient_accumulation={steps} must divide batch_size={batch_size} (each of the {steps} "
                         f"minibatches gets batch_size / {steps} examples); use one of {divisors}")
    merged["minibatch_size"] = batch_size // steps


def _save_dir(merged: dict[str, Any]) -> None:
    save_dir = merged.pop("save_dir", None)
    if save_dir is None:
        return
    if merged.get("checkpoint_dir") is not None:
        raise TypeError(f"Trainer.fit got both save_dir={save_dir!r} and checkpoint_dir={merged['checkpoint_dir']!r}; "
                        "save_dir is the original EXO Gym's folder of checkpoints, pass one of them")
    merged["checkpoint_dir"] = Path(save_dir) / merged["run_name"]  # as the original: one folder per run under it


def _wandb(merged: dict[str, Any]) -> None:
    project = merged.pop("wandb_project", None)
    x_axis = merged.pop("log_x_axis", "step")
    if x_axis not in ("step", "examples"):
        raise ValueError(f"log_x_axis must be 'step' or 'examples', got {x_axis!r}")
    from exogym.logger import CSVLogger, Logger, WandbLogger

    if project is None:
        given = merged.get("logger")
        given = [given] if isinstance(given, Logger) else given if isinstance(given, (list, tuple)) else []
        wandb_loggers = [lg for lg in given if isinstance(lg, WandbLogger)]
        for lg in wandb_loggers:  # the W&B loggers passed in take the x-axis
            lg.x_axis = x_axis
        if x_axis != "step" and not wandb_loggers:
            raise TypeError("log_x_axis='examples' sets the x-axis of a W&B logger, and this run has none; add "
                            "wandb_project=..., or pass logger=WandbLogger(project, x_axis='examples')")
        return

    wandb_logger = WandbLogger(project=project, run_name=merged["run_name"], x_axis=x_axis)
    logger = merged.get("logger")
    if logger is None or logger is True:
        merged["logger"] = [CSVLogger(run_name=merged["run_name"]), wandb_logger]  # the CSV run folder stays
    elif logger is False:
        merged["logger"] = wandb_logger
    elif isinstance(logger, Logger):
        merged["logger"] = [logger, wandb_logger]
    else:
        merged["logger"] = [*logger, wandb_logger]
