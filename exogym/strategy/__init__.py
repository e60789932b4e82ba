"""Strategies: what each node does at every step, and what it communicates."""

from exogym.strategy.optim import OptimSpec
from exogym.strategy.strategy import SimpleReduceStrategy, Strategy

__all__ = ["Strategy", "SimpleReduceStrategy", "OptimSpec"]
