"""What a backend raises when a node fails or gets stuck: the same classes on both backends."""

from __future__ import annotations

__all__ = ["DEFAULT_NODE_TIMEOUT", "STUCK_EXIT_CODE", "NodeTimeoutError", "NodeProcessError"]

# Ten minutes: far above any single step or validation of the models this library is used with on one machine,
# and far below "the run hangs overnight". fit(node_timeout=...) changes it; None disables the watchdog.
DEFAULT_NODE_TIMEOUT = 600.0
# A process's exit status when a node stuck in native code ended it (GNU timeout's "timed out"): the sim's watchdog
# exits with it, and a launcher reading a process's exit tells the caller why it ended.
STUCK_EXIT_CODE = 124

class NodeTimeoutError(RuntimeError):
    """A node ran for longer than fit's node_timeout without finishing a step or reaching a collective (sim), or
    never reached a collective the others waited in (torch). `rank` and `step` name it (step None: before the
    first step)."""

    def __init__(self, message: str, rank: int, step: int | None):
        super().__init__(message)
        self.rank, self.step = rank, step

    def __reduce__(self) -> tuple:  # crosses from a torch backend node's process to the caller intact
        return type(self), (str(self), self.rank, self.step)


class NodeProcessError(RuntimeError):
    """A node's process failed (raised, or died) and the run was stopped. The message names the node and holds
    its traceback; `rank` is the node, and `__cause__` the node's exception when it could be sent back."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank
