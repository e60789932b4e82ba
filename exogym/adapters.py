"""Argument adapters: where a layer above the core rewrites a public call's arguments before the core sees them.

The core knows nothing of other libraries' spellings. Its public constructors (classes whose metaclass is
`Adaptable`) and `Trainer.fit` (wrapped by `adaptable`) offer this hook instead: a layer on top registers an
adapter for a class or function, and every call then passes through it. `exogym.compat` registers the original
EXO Gym's spellings here. With nothing registered a call is unchanged, and the objects only ever see the
canonical keywords.

An adapter returns the arguments it made and the settings it dropped as having no effect,
`(args, kwargs, ignored)` with `ignored = {name: (value, why)}` (one that drops nothing may return
`(args, kwargs)`). The settings are handed on explicitly: to an adaptable function through its keyword-only
parameter `ignored_settings` (hidden from its shown signature), to an object through its
`_keep_ignored_settings(ignored)` method, called right after it is built.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

__all__ = ["Adapter", "Adaptable", "adaptable", "register_adapter", "IGNORED_PARAMETER"]

# adapter(target, args, kwargs) -> (args, kwargs, {name: (value, why)}); target: the class being constructed, or the
# wrapped function.
Adapter = Callable[[Any, tuple, dict], "tuple[tuple, dict, dict[str, tuple[Any, str]]]"]
IGNORED_PARAMETER = "ignored_settings"  # how an adaptable function receives what its adapters dropped

_ADAPTERS: dict[object, list[Adapter]] = {}


def register_adapter(target: object, adapter: Adapter) -> None:
    """Run `adapter` on the arguments of every call of `target`: a class whose metaclass is `Adaptable` (its
    subclasses included), or a function wrapped by `adaptable`."""
    if not (isinstance(target, Adaptable) or getattr(target, "_adaptable", False)):
        raise TypeError(f"{target!r} offers no argument hook (an Adaptable class or an @adaptable function)")
    _ADAPTERS.setdefault(target, []).append(adapter)


def _adapt(adapters: Iterable[Adapter], target: Any, args: tuple,
           kwargs: dict) -> tuple[tuple, dict, dict[str, tuple[Any, str]]]:
    """Run `adapters` in turn; return the final arguments and every setting they dropped."""
    ignored: dict[str, tuple[Any, str]] = {}
    for adapter in adapters:
        out = adapter(target, args, kwargs)
        if len(out) == 3:
            args, kwargs, dropped = out
            ignored.update(dropped or {})
        else:
            args, kwargs = out
    return args, kwargs, ignored


class Adaptable(type):
    """Metaclass: before `__new__`/`__init__`, the adapters registered for the class and each of its bases run,
    base classes first, on the constructor's arguments; the settings they dropped go to the new object's
    `_keep_ignored_settings`."""

    def __call__(cls, /, *args: Any, **kwargs: Any) -> Any:  # positional-only: OptimSpec takes cls=
        adapters = [a for klass in reversed(cls.__mro__) for a in _ADAPTERS.get(klass, ())]
        args, kwargs, ignored = _adapt(adapters, cls, args, kwargs)
        obj = super().__call__(*args, **kwargs)
        if ignored:
            keep = getattr(obj, "_keep_ignored_settings", None)
            if keep is None:
                raise TypeError(f"an argument adapter dropped {sorted(ignored)} for {cls.__name__}, which cannot "
                                "record settings without effect")
            keep(ignored)
        return obj


def adaptable(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `func` so adapters registered for it rewrite its arguments; `help()` and `inspect.signature` still show
    `func`'s own parameters (without `ignored_settings`, through which `func` receives what the adapters dropped,
    when it declares that keyword-only parameter)."""
    signature = inspect.signature(func)
    takes_ignored = IGNORED_PARAMETER in signature.parameters
    if takes_ignored and signature.parameters[IGNORED_PARAMETER].kind is not inspect.Parameter.KEYWORD_ONLY:
        raise TypeError(f"{func.__qualname__} must declare {IGNORED_PARAMETER} keyword-only")
    shown = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != IGNORED_PARAMETER])

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        if IGNORED_PARAMETER in kwargs:
            raise TypeError(f"{func.__qualname__}() got an unexpected keyword argument {IGNORED_PARAMETER!r}")
        args, kwargs, ignored = _adapt(_ADAPTERS.get(call, ()), func, args, kwargs)
        if takes_ignored:
            return func(*args, **kwargs, **{IGNORED_PARAMETER: ignored})
        if ignored:
            raise TypeError(f"an argument adapter dropped {sorted(ignored)} for {func.__qualname__}, which cannot "
                            "record settings without effect")
        return func(*args, **kwargs)

    call.__signature__ = shown
    call._adaptable = True
    return call
