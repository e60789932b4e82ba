"""What the original EXO Gym's strategy skeletons call on the Strategy base class (its llms.txt): a subclass that
builds its optimizer in `_init_node` calls `self._setup_scheduler()` after it, and ends `step()` with
`super().step()`.

`_setup_scheduler()` is `Strategy.build_scheduler()`: it builds the LR schedule over `self.optim` once (the base
class does it after `_init_node` anyway, so calling it is harmless and leaving it out changes nothing).
`super().step()` is the base class's own: it advances the LR schedule and the step count.
"""

from __future__ import annotations

__all__ = ["install"]


def _setup_scheduler(self) -> None:
    """The original's name for Strategy.build_scheduler(): build the LR schedule over self.optim, once."""
    self.build_scheduler()


def install() -> None:
    from exogym.strategy.base import Strategy

    Strategy._setup_scheduler = _setup_scheduler
