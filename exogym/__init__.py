"""ExoGym: simulate distributed, low-communication training on one machine.

Words used throughout:
- node: one (simulated or real) worker holding its own copy of the model; `rank` is its index
  in 0..num_nodes-1.
- step: one optimizer step of a node on one batch (its inner step, for two-level strategies).
- round: one outer synchronisation of a strategy that communicates every H steps.
"""

from exogym.backends.torch_spawn import NodeProcessError
from exogym.backends.watchdog import NodeTimeoutError
from exogym.comm import CollectiveError
from exogym.membership import RandomFailures
from exogym.record import RunRecord
from exogym.run_folder import RunFolderError
from exogym.trainer import LocalTrainer, Trainer

__all__ = ["Trainer", "LocalTrainer", "RunRecord", "CollectiveError", "NodeProcessError", "NodeTimeoutError",
           "RunFolderError", "RandomFailures"]
__version__ = "0.1.0"
