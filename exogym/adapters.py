"""Argument adapters: where a layer above the core rewrites a public call's arguments before the core sees them.

The core knows nothing of other libraries' spellings. Its public constructors (classes whose metaclass is
`Adaptable`) and `Trainer.fit` (wrapped by `adaptable`) offer this hook instead: a layer on top registers an
adapter for a class or function, and every call then passes through it. `exogym.compat` registers the original
EXO Gym's spellings here. With nothing registered a call is unchanged, and the objects only ever see the
canonical keywords.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = ["Adapter", "Adaptable", "adaptable", "register_adapter"]

# adapter(target, args, kwargs) -> (args, kwargs); target: the class being constructed, or the wrapped function.
Adapter = Callable[[Any, tuple, dict], "tuple[tuple, dict]"]

_ADAPTERS: dict[object, list[Adapter]] = {}


def register_adapter(target: object, adapter: Adapter) -> None:
    """Run `adapter` on the arguments of every call of `target`: a class whose metaclass is `Adaptable` (its
    subclasses included), or a function wrapped by `adaptable`."""
    if not (isinstance(target, Adaptable) or getattr(target, "_adaptable", False)):
        raise TypeError(f"{target!r} offers no argument hook (an Adaptable class or an @adaptable function)")
    _ADAPTERS.setdefault(target, []).append(adapter)


class Adaptable(type):
    """Metaclass: before `__new__`/`__init__`, the adapters registered for the class and each of its bases run,
    base classes first, on the constructor's arguments."""

    def __call__(cls, /, *args: Any, **kwargs: Any) -> Any:  # positional-only: OptimSpec takes cls=
        for klass in reversed(cls.__mro__):
            for adapter in _ADAPTERS.get(klass, ()):
                args, kwargs = adapter(cls, args, kwargs)
        return super().__call__(*args, **kwargs)


def adaptable(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `func` so adapters registered for it rewrite its arguments; `help()` and `inspect.signature` still show
    `func`'s own parameters."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        for adapter in _ADAPTERS.get(call, ()):
            args, kwargs = adapter(func, args, kwargs)
        return func(*args, **kwargs)

    call.__signature__ = inspect.signature(func)
    call._adaptable = True
    return call
