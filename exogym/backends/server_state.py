"""A strategy's server's state as plain data and tensors, and the shadow a node away from the server reads it in,
shared by the backends: the sim's checkpoints and reads from another process (exogym.backends.sim.serverhost,
postproxy), and the torch backend's reads from a rank other than 0 (exogym.backends.torch.server_reads)."""

from __future__ import annotations

from typing import Any

from exogym.comm.messages import Message, Server

__all__ = ["server_state", "load_server", "check_readable", "ShadowPost"]


def server_state(server: Server, since: int = 0) -> dict[str, Any]:
    """The server's state as plain data and tensors: its `state_dict()`, its clock, the update rows from row
    `since` on, and its byte counts.

    Args:
        server: The server.
        since: The update rows the reader already holds (0: all of them).

    Returns:
        What load_server takes.
    """
    stats = server.stats
    return {"state": server.state_dict(), "now": server.now, "updates": [dict(u) for u in server.updates[since:]],
            "stats": {"bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                      "payload_bytes": stats.payload_bytes}}


def load_server(server: Server, saved: dict[str, Any]) -> None:
    """Put what server_state returned (with every update row) into `server`.

    Args:
        server: The server to load into.
        saved: What server_state returned.
    """
    server.load_state_dict(saved["state"])
    server.now, server.updates[:] = saved["now"], [dict(u) for u in saved["updates"]]
    server.stats.bytes_sent = saved["stats"]["bytes_sent"]
    server.stats.bytes_received = saved["stats"]["bytes_received"]
    server.stats.payload_bytes = saved["stats"]["payload_bytes"]
    if "sent" in saved:  # a checkpoint's: the messages it sent before, for the run's timeline
        server.sent_log.messages = {c: list(v) for c, v in saved["sent"].items()}


def check_readable(server: Server, rank: int, where: str) -> None:
    """A shadow can only be as right as the server's state_dict: a class keeping none is an error before a read.

    Args:
        server: The shadow.
        rank: The reading node.
        where: Where the server runs, in words.

    Raises:
        RuntimeError: the server's class does not define state_dict and load_state_dict.
    """
    kind = type(server)
    if kind.state_dict is Server.state_dict or kind.load_state_dict is Server.load_state_dict:
        raise RuntimeError(f"read_server on node {rank}: the server runs in {where}, and a node elsewhere reads it "
                           f"through its state: {kind.__name__} must define state_dict() and load_state_dict() "
                           "holding what is read (checkpoints need them too)")


class ShadowPost:
    """What a shadow server's `send` and timers go through: nothing, the server runs in `where` (in words)."""

    def __init__(self, num_nodes: int, where: str):
        self.num_nodes, self.where = num_nodes, where

    def _refuse(self) -> None:
        raise RuntimeError(f"this server is a shadow of the run's server, which runs in {self.where}; it only holds "
                           "the state read_server read, and sends nothing")

    def post(self, message: Message) -> None:
        self._refuse()

    def wake_server(self, at: float) -> None:
        self._refuse()
