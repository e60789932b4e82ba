"""OptimSpec: an optimizer class and its hyperparameters, built once per node."""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Iterable

import torch

from exogym._validation import reject_unknown_kwargs
from exogym.adapters import Adaptable

__all__ = ["OptimSpec", "ensure_optim_spec", "OPTIMIZERS"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
}


def _optimizer_keywords(cls: type) -> set[str] | None:
    """The keywords cls's constructor takes besides `params`; None if it takes **kwargs (anything goes)."""
    params = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.name not in ("self", "params")}


class OptimSpec(metaclass=Adaptable):
    """An optimizer class and its keywords: `OptimSpec(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)`.

    Also `OptimSpec.from_string("adamw", lr=3e-4)`. Keywords are checked against the optimizer's constructor
    here, so a typo fails before any node starts. `OptimSpec(optimizer_class=...)` and `OptimSpec.from_str(...)`
    are the original documents' spellings.

    Args:
        cls: A `torch.optim.Optimizer` class (default AdamW).
        **kwargs: The optimizer's keywords (lr, weight_decay, betas, ...).

    Raises:
        TypeError: `cls` is not an optimizer class, or a keyword it does not take (listing those it does).
        ValueError: A non-finite number, or a negative lr.
    """

    def __init__(self, cls: type[torch.optim.Optimizer] | str = torch.optim.AdamW, **kwargs: Any):
        if isinstance(cls, str):
            cls = _optimizer_class(cls)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"OptimSpec needs a torch.optim.Optimizer subclass or one of {sorted(OPTIMIZERS)}, "
                            f"got {cls!r}")
        accepted = _optimizer_keywords(cls)
        if accepted is not None:
            reject_unknown_kwargs(f"OptimSpec({cls.__name__})", {k: v for k, v in kwargs.items() if k not in accepted},
                                  accepted)
        _check_hyperparameters(cls, kwargs)
        self.cls = cls
        self.kwargs = dict(kwargs)

    @classmethod
    def from_string(cls, name: str, **kwargs: Any) -> "OptimSpec":
        """The spec of a named optimizer: `OptimSpec.from_string("adamw", lr=3e-4)`.

        Args:
            name: An optimizer name such as `"adamw"`, `"adam"`, `"sgd"` (case-insensitive).
            **kwargs: The optimizer's keywords.

        Returns:
            The OptimSpec.

        Raises:
            ValueError: An unknown name (listing the known ones).
        """
        return cls(_optimizer_class(name), **kwargs)

    from_str = from_string  # the original repository's name

    def build(self, model_or_params: torch.nn.Module | Iterable[Any]) -> torch.optim.Optimizer:
        """Build the optimizer over a model's parameters.

        Args:
            model_or_params: A module (its `parameters()`) or an iterable of parameters or parameter groups.

        Returns:
            The optimizer.
        """
        params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
        return self.cls(params, **self.kwargs)

    def with_defaults(self, **defaults: Any) -> "OptimSpec":
        """A copy whose missing hyperparameters take `defaults` (explicit settings win).

        Args:
            **defaults: Hyperparameters to use where the spec has none.

        Returns:
            The new OptimSpec.
        """
        return OptimSpec(self.cls, **{**defaults, **self.kwargs})

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"OptimSpec({self.cls.__name__}{args})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OptimSpec) and (self.cls, self.kwargs) == (other.cls, other.kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The spec as plain data for a run's config: `{"optimizer": class name, **keywords}`.

        Returns:
            The dict.
        """
        return {"optimizer": self.cls.__name__, **self.kwargs}


def _check_hyperparameters(cls: type, kwargs: dict[str, Any]) -> None:
    """Numbers an optimizer is given are finite, and lr is >= 0: torch takes lr=inf and turns every weight into nan
    at the first step. Tensors (a tensor lr) and other values are the optimizer's to check."""
    for name, value in kwargs.items():
        numbers = value if isinstance(value, tuple) else (value,)  # betas=(0.9, 0.999)
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"OptimSpec({cls.__name__}) got {name}={value!r}; {name} must be finite")
    lr = kwargs.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr < 0:
        raise ValueError(f"OptimSpec({cls.__name__}) got lr={lr!r}; a learning rate must be >= 0")


def _optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    try:
        return OPTIMIZERS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer name {name!r}; use one of {sorted(OPTIMIZERS)} "
                         "or pass OptimSpec(YourOptimizerClass, ...)") from None


def ensure_optim_spec(optim: OptimSpec | str | type | None, default: OptimSpec | None = None,
                      **kwargs: Any) -> OptimSpec | None:
    """Turn what a user passed for an optimizer (spec, name, class or None) into an OptimSpec.

    `kwargs` (e.g. lr=...) set hyperparameters when `optim` is a name or class; next to a full
    OptimSpec they override its values (the original documents pass optim_spec and inner_lr together).
    """
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if optim is None:
        if default is None:
            return None
        return default.with_defaults() if not kwargs else OptimSpec(default.cls, **{**default.kwargs, **kwargs})
    if isinstance(optim, OptimSpec):  # settings next to a full spec win (DiLoCoStrategy(optim_spec=..., inner_lr=...))
        return OptimSpec(optim.cls, **{**optim.kwargs, **kwargs}) if kwargs else optim
    if isinstance(optim, str) or inspect.isclass(optim):
        return OptimSpec(optim, **kwargs)
    raise TypeError(f"an optimizer must be an OptimSpec, a name such as 'adamw', or an Optimizer class; got {optim!r}")


def pop_optimizer_options(owner: str, optim: OptimSpec | str | type | None, default: OptimSpec | None,
                          kwargs: dict[str, Any], owner_keywords: Iterable[str]) -> dict[str, Any]:
    """The name form's options: `SPARTAStrategy("sgd", lr=0.05, momentum=0.9)`.

    Removes from `kwargs` (a strategy's leftover keywords, those it does not take itself) the ones that
    are options of its inner optimizer (named, a class, or the strategy's default) and returns them. A
    keyword that is neither the strategy's nor the optimizer's is a TypeError naming both lists.
    """
    leftover = {k: v for k, v in kwargs.items() if k not in set(owner_keywords)}
    if not leftover:
        return {}
    if isinstance(optim, OptimSpec):
        cls, options = optim.cls, None  # a full spec holds its own options
    else:
        cls = _optimizer_class(optim) if isinstance(optim, str) else optim if optim is not None else (
            default.cls if default is not None else None)
        options = _optimizer_keywords(cls) if inspect.isclass(cls) else set()
        if options is None:  # the optimizer takes **kwargs: whatever the strategy does not take is its
            return {k: kwargs.pop(k) for k in leftover}
    accepted = options or set()
    unknown = sorted(k for k in leftover if k not in accepted)
    if unknown:
        mine = sorted(set(owner_keywords))
        parts = []
        for k in unknown:
            close = difflib.get_close_matches(k, mine + sorted(accepted), n=1)
            parts.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        name = getattr(cls, "__name__", None)
        theirs = ("" if name is None else f"; options of {name} go inside the OptimSpec ({optim!r})"
                  if options is None else f"; its optimizer {name} accepts: {', '.join(sorted(accepted))}")
        raise TypeError(f"{owner} got unexpected keyword argument(s) {', '.join(parts)}; accepted keywords are: "
                        f"{', '.join(mine)}{theirs}")
    return {k: kwargs.pop(k) for k in leftover}
