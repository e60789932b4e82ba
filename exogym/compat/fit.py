"""Trainer.fit as the original EXO Gym called it: fit(num_epochs, strategy, num_nodes, ...) positionally, and its
keywords correlation_interval, kwargs, gradient_accumulation, save_dir, wandb_project, log_x_axis and
disable_logging, mapped to fit's own keywords before fit runs (registered on Trainer.fit's argument hook).

- save_dir= is the folder of checkpoints when checkpoint_interval is given, and nothing is written otherwise;
- wandb_project= adds a WandbLogger next to the CSV run folder; log_x_axis without W&B has no effect, said by one
  warning; disable_logging=True is logger=False.
Settings that had no effect are returned to the hook with the arguments (exogym.adapters), which hands them to fit:
config.json lists them apart. What a rerun does and which files a run folder holds is one rule for every call
style, the core's (exogym.runs.folder, exogym.compat.run_files).
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from exogym._validation import check_int, reject_unknown_kwargs
from exogym.adapters import IGNORED_PARAMETER, register_adapter

__all__ = ["FIT_ALIASES", "ORIGINAL_FIT_ORDER", "ORIGINAL_ONLY", "fit_arguments", "install"]

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
# The keywords only the original's fit has (accepted even as None, as its scripts pass them).
ORIGINAL_ONLY = ("save_dir", "wandb_project", "log_x_axis", "gradient_accumulation", "disable_logging") + \
    tuple(FIT_ALIASES)
_ISSUED: set[str] = set()  # run names this process generated (two in one second never share one)


def fit_arguments(target: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, str]]]:
    """Trainer.fit's arguments, in either positional order and either spelling, as `target`'s canonical keywords.

    fit(strategy, num_nodes, **options) is this library's order; fit(num_epochs, strategy, num_nodes, max_steps,
    device, ...) the original's (recognised by an int first). Original-only keywords become canonical ones:
    correlation_interval -> diagnostics_interval, kwargs -> extra_config, gradient_accumulation=n ->
    minibatch_size=batch_size // n, save_dir (with checkpoint_interval) -> checkpoint_dir=<save_dir>/<run_name>,
    wandb_project (+ log_x_axis) -> a WandbLogger next to the other loggers, disable_logging=True -> logger=False.
    Returns the keywords and the settings that had no effect, {name: (value, why)}.
    """
    params = inspect.signature(target).parameters
    canonical_names = [p for p in params if p not in ("self", IGNORED_PARAMETER) and params[p].kind not in (
        inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
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
                                          if k not in canonical_names and k not in ORIGINAL_ONLY},
                          canonical_names + list(ORIGINAL_ONLY))
    for alias, canonical in FIT_ALIASES.items():
        if alias in merged:
            if canonical in merged:
                raise TypeError(f"Trainer.fit got both {alias}= and {canonical}=; {alias} is the original EXO Gym's "
                                f"name for {canonical}, pass one of them")
            merged[canonical] = merged.pop(alias)
    if merged.get("device") == "":
        merged["device"] = None  # the original's "" (its scripts' default): pick the best device available
    _gradient_accumulation(merged, params)
    ignored: dict[str, tuple[Any, str]] = {}
    _save_dir(merged, params, ignored)
    _disable_logging(merged)
    _loggers(merged, ignored)
    return merged, ignored


def _disable_logging(merged: dict[str, Any]) -> None:
    """disable_logging=True: no logger (no run folder, no W&B), as logger=False."""
    disable = merged.pop("disable_logging", None)
    if disable is None or disable is False:
        return
    if disable is not True:
        raise TypeError(f"disable_logging must be True or False, got {disable!r}")
    given = {k: merged[k] for k in ("logger", "wandb_project") if merged.get(k) not in (None, False)}
    if given:
        shown = ", ".join(f"{k}={v!r}" for k, v in given.items())
        raise TypeError(f"Trainer.fit got disable_logging=True and {shown}; disable_logging=True logs nothing, pass "
                        "one of them")
    merged["logger"] = False


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


def _save_dir(merged: dict[str, Any], params: Mapping[str, Any],
              ignored: dict[str, tuple[Any, str]]) -> Path | None:
    """save_dir is where the checkpoints of checkpoint_interval go, <save_dir>/<run_name>/step_*/ (a run name is
    made when none is given; that folder is returned); without checkpoint_interval the original saved nothing, and
    nothing is saved."""
    save_dir = merged.pop("save_dir", None)
    if save_dir is None:
        return None
    if merged.get("checkpoint_dir") is not None:
        raise TypeError(f"Trainer.fit got both save_dir={save_dir!r} and checkpoint_dir={merged['checkpoint_dir']!r}; "
                        "save_dir is the original EXO Gym's folder of checkpoints, pass one of them")
    if merged.get("checkpoint_interval") is None:
        ignored["save_dir"] = (str(save_dir), "no checkpoint_interval: nothing is saved (as the original)")
        return None
    if merged.get("run_name") is None:
        merged["run_name"] = _new_run_name(merged, params, [Path(save_dir), *_log_roots(merged.get("logger"))])
    merged["checkpoint_dir"] = Path(save_dir) / merged["run_name"]  # as the original: one folder per run under it
    return merged["checkpoint_dir"]


def _new_run_name(merged: dict[str, Any], params: Mapping[str, Any], roots: list[Path]) -> str:
    """A default run name (strategy, nodes, time) free under every root and not made before in this process."""
    from exogym.runs.loggers import default_run_name

    base = default_run_name({"strategy": type(merged.get("strategy")).__name__,
                             "num_nodes": merged.get("num_nodes", params["num_nodes"].default)})
    n = 1
    while True:
        name = base if n == 1 else f"{base}-{n}"
        if name not in _ISSUED and not any((root / name).exists() for root in roots):
            _ISSUED.add(name)
            return name
        n += 1


def _log_roots(logger: Any) -> list[Path]:
    """The folders under which `logger` (fit's logger argument) claims run folders: logs/ by default."""
    from exogym.runs.loggers import Logger, _FolderLogger

    if logger is None or logger is True:
        return [Path("logs")]
    given = [logger] if isinstance(logger, Logger) else list(logger) if isinstance(logger, (list, tuple)) else []
    return [lg.log_dir for lg in given if isinstance(lg, _FolderLogger)]


def _loggers(merged: dict[str, Any], ignored: dict[str, tuple[Any, str]]) -> None:
    """The CSV run folder, and a WandbLogger for wandb_project, which takes log_x_axis (as do the W&B loggers passed
    in); without W&B, log_x_axis has no effect."""
    from exogym.runs.loggers import CSVLogger, Logger, WandbLogger

    project = merged.pop("wandb_project", None)
    given_axis = "log_x_axis" in merged
    x_axis = merged.pop("log_x_axis", "step")
    if x_axis not in ("step", "examples"):
        raise ValueError(f"log_x_axis must be 'step' or 'examples', got {x_axis!r}")
    logger = merged.get("logger")
    given = [logger] if isinstance(logger, Logger) else list(logger) if isinstance(logger, (list, tuple)) else []
    for lg in given:
        if isinstance(lg, WandbLogger):  # the W&B loggers passed in take the x-axis
            lg.x_axis = x_axis
    if project is None and not any(isinstance(lg, WandbLogger) for lg in given) and given_axis:
        ignored["log_x_axis"] = (x_axis, "it sets the x-axis of W&B charts, and this run logs to no W&B")
        if x_axis != "step":
            from exogym.compat.spellings import caller_level
            warnings.warn(f"log_x_axis={x_axis!r} has no effect: it sets the x-axis of W&B charts only, and this run "
                          "logs to no W&B (pass wandb_project=... for charts against examples)", UserWarning,
                          stacklevel=caller_level())
    if project is None:
        return
    loggers = [CSVLogger(run_name=merged.get("run_name"))] if logger is None or logger is True else given
    loggers = [*loggers, WandbLogger(project=project, run_name=merged.get("run_name"), x_axis=x_axis)]
    merged["logger"] = loggers[0] if len(loggers) == 1 else loggers


def _adapt_fit(fit: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple, dict, dict[str, tuple[Any, str]]]:
    trainer, rest = args[0], args[1:]
    merged, ignored = fit_arguments(fit, rest, kwargs)
    return (trainer,), merged, ignored


def install() -> None:
    from exogym.fit.trainer import Trainer

    register_adapter(Trainer.fit, _adapt_fit)
