"""The sim backend: every node is a cooperative thread of this process, collectives are tensor ops."""

from exogym.backends.sim.run import SIM, run_sim

__all__ = ["run_sim", "SIM"]
