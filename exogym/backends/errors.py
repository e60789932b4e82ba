"""What a backend raises when a node fails or gets stuck: the same classes on both backends."""

from __future__ import annotations

__all__ = ["DEFAULT_NODE_TIMEOUT", "STUCK_EXIT_CODE", "NodeTimeoutError", "ServerTimeoutError", "NodeProcessError",
           "PeerLostError", "with_rank_note"]

# Ten minutes: far above any single step or validation of the models this library is used with on one machine,
# and far below "the run hangs overnight". fit(node_timeout=...) changes it; None disables the watchdog.
DEFAULT_NODE_TIMEOUT = 600.0
# A process's exit status when a node stuck in native code ended it (GNU timeout's "timed out"): the sim's watchdog
# exits with it, and a launcher reading a process's exit tells the caller why it ended.
STUCK_EXIT_CODE = 124

class NodeTimeoutError(RuntimeError):
    """A node ran for longer than fit's `node_timeout` without finishing a step or reaching a collective (sim).

    Under the torch backend: a node never reached a collective the others waited in.

    Args:
        message: What happened (the node, its step and, under the sim backend, its Python stack).
        rank: The node.
        step: Its step (None: before the first step).
    """

    def __init__(self, message: str, rank: int, step: int | None):
        super().__init__(message)
        self.rank, self.step = rank, step

    def __reduce__(self) -> tuple:  # crosses from a torch backend node's process to the caller intact
        return type(self), (str(self), self.rank, self.step)


class ServerTimeoutError(NodeTimeoutError):
    """A strategy's server ran one handler (its `receive` of a message, or `wake` on a timer) for longer than fit's
    `node_timeout` without returning; the run counts as stuck, like a stuck node.

    `rank` is SERVER (-1) and `step` None; `server` names its class and `handling` what it was handling.

    Args:
        message: What happened (the server, the message and, where it can be read, the handler's Python stack).
        server: The server's class name.
        handling: The message (or timer) it was handling.
    """

    def __init__(self, message: str, server: str, handling: str):
        super().__init__(message, -1, None)
        self.server, self.handling = server, handling

    def __reduce__(self) -> tuple:  # crosses from a torch backend node's process to the caller intact
        return type(self), (str(self), self.server, self.handling)


class NodeProcessError(RuntimeError):
    """A node's process failed (raised, or died) and the run was stopped.

    The message names the node and holds its traceback; `__cause__` is the node's exception when it could be
    sent back.

    Args:
        message: What happened, with the node's traceback.
        rank: The node.
    """

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class PeerLostError(NodeProcessError):
    """Another process of the run went away (its connection closed: it died, or its machine did) or stopped
    responding (no heartbeat for node_timeout: stopped, hung, or cut off by a network partition). `process` and
    `nodes` name it; `rank` is its first node.

    Args:
        message: What happened, naming the process and its nodes.
        process: The lost process's index (its torchrun rank).
        nodes: The nodes it hosts.
    """

    def __init__(self, message: str, process: int, nodes: tuple[int, ...]):
        super().__init__(message, nodes[0] if nodes else -1)
        self.process, self.nodes = process, tuple(nodes)

    def __reduce__(self) -> tuple:  # crosses from a run's process to the caller intact
        return type(self), (str(self), self.process, self.nodes)


def describe_process(process: int, nodes: tuple[int, ...]) -> str:
    """'process 1 (node 1)' or 'process 1 (nodes 2-3)'."""
    if len(nodes) == 1:
        return f"process {process} (node {nodes[0]})"
    return f"process {process} (nodes {nodes[0]}-{nodes[-1]})"


def with_rank_note(error: BaseException, rank: int, process: int | None = None) -> BaseException:
    """An exception raised in another process, as itself (its type kept: `except DiskFullError` still works), with a
    note naming where it was raised."""
    where = f"node {rank}" + (f" (process {process})" if process is not None else "")
    note = f"(raised in the process of {where}; the run's other processes were ended)"
    if note not in getattr(error, "__notes__", []):
        error.add_note(note)
    return error
