"""`exogym.strategy.strategy` as the original EXO Gym laid it out: the Strategy base and DDP in one module."""

from exogym.strategy.base import Strategy, parameter_state
from exogym.strategy.context import NodeContext
from exogym.strategy.ddp import SimpleReduceStrategy

__all__ = ["Strategy", "SimpleReduceStrategy", "NodeContext", "parameter_state"]
