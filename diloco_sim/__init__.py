"""The diloco-sim interface on top of ExoGym's engine: `from diloco_sim import DilocoSimulator`."""

from diloco_sim.simulator import DilocoSimulator, EvalStats, TrainStats

__all__ = ["DilocoSimulator", "TrainStats", "EvalStats"]
