"""Trainer.fit as the original EXO Gym called it: fit(num_epochs, strategy, num_nodes, ...) positionally, and its
keywords correlation_interval, kwargs, gradient_accumulation, save_dir, wandb_project and log_x_axis, mapped to
fit's own keywords before fit runs (registered on Trainer.fit's argument hook)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

from exogym._validation import check_int, reject_unknown_kwargs
from exogym.adapters import register_adapter

__all__ = ["FIT_ALIASES", "ORIGINAL_FIT_ORDER", "fit_arguments", "install"]

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


def fit_arguments(target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer.fit's arguments, in either positional order and either spelling, as `target`'s canonical keywords.

    fit(strategy, num_nodes, **options) is this library's order; fit(num_epochs, strategy, num_nodes, max_steps,
    device, ...) the original's (recognised by an int first). Original-only keywords become canonical ones:
    correlation_interval -> diagnostics_interval, kwargs -> extra_config, gradient_accumulation=n ->
    minibatch_size=batch_size // n, save_dir -> checkpoint_dir=<save_dir>/<run_name>, wandb_project (+ log_x_axis)
    -> a WandbLogger next to the other loggers.
    """
    params = inspect.signature(target).parameters
    canonical_names = [p for p in params if p != "self" and params[p].kind not in (inspect.Parameter.VAR_KEYWORD,
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
        from exogym.runs.loggers import default_run_name  # one name for logs/, the checkpoints and the W&B run
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
    from exogym.runs.loggers import CSVLogger, Logger, WandbLogger

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


def _adapt_fit(fit: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    trainer, rest = args[0], args[1:]
    return (trainer,), fit_arguments(fit, rest, kwargs)


def install() -> None:
    from exogym.trainer import Trainer

    register_adapter(Trainer.fit, _adapt_fit)
