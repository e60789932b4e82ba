"""ExoGym: simulate distributed, low-communication training on one machine.

Words used throughout:
- node: one (simulated or real) worker holding its own copy of the model; `rank` is its index
  in 0..num_nodes-1.
- step: one optimizer step of a node on one batch (its inner step, for two-level strategies).
- round: one outer synchronisation of a strategy that communicates every H steps.
"""

from exogym.backends.errors import NodeProcessError, NodeTimeoutError, PeerLostError, ServerTimeoutError
from exogym.cluster.membership import RandomFailures
from exogym.cluster.slowdowns import RandomSlowdowns
from exogym.comm.transport import CollectiveError
from exogym.engine.node import NonFiniteLoss
from exogym.launch.signals import RunInterrupted
from exogym.runs.folder import RunFolderError
from exogym.runs.disk import DiskFullError
from exogym.runs.record import RunRecord
from exogym.fit.trainer import LocalTrainer, Trainer

from exogym import compat  # noqa: E402 - on top of everything above, and installed last

compat.install()

__all__ = ["Trainer", "LocalTrainer", "RunRecord", "CollectiveError", "NodeProcessError", "NodeTimeoutError",
           "ServerTimeoutError", "RunFolderError", "DiskFullError", "RandomFailures", "RandomSlowdowns", "NonFiniteLoss", "RunInterrupted",
           "PeerLostError"]
__version__ = "0.1.0"
