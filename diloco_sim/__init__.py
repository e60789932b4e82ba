"""The diloco-sim interface on top of ExoGym's engine: `from diloco_sim import DilocoSimulator`."""

from exogym.compat.diloco_sim import DilocoSimulator, EvalStats, TrainStats

__all__ = ["DilocoSimulator", "TrainStats", "EvalStats"]
