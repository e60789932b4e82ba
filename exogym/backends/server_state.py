"""A strategy's server's state as plain data and tensors, shared by the backends: the sim's checkpoints and reads from
another process (exogym.backends.sim.serverhost, postproxy), and the torch backend's reads from a rank other than 0
(exogym.backends.torch.server_reads)."""

from __future__ import annotations

from typing import Any

from exogym.comm.messages import Server

__all__ = ["server_state", "load_server"]


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
