"""`read_server` from a rank other than 0 on the torch backend: what travels, and the shadow server it is loaded into.

The server runs on a thread of rank 0's process (exogym.backends.torch.messages). Every other rank holds a shadow of
it, made by the same factory (`serve` returns it), as the sim's processes away from the keeper do
(exogym.backends.sim.postproxy). A read sends a request (a header of its own kind, on the messages' channel) to rank
0, whose receiver queues it with the server's messages; the server's thread handles it between two messages, under
the server's lock, and answers with the server's state (`server_state`: its `state_dict()`, clock, the update rows the
reader does not hold yet, byte counts), pickled with torch.save. The reader loads the answer into its shadow and calls
the read function on the shadow.

As of when: the server's queue is in the order rank 0's receiver took its items, which is wall-clock order at the
server. A read sees every message handled before the request reached the queue, none after, and never a handler's
half-done state. Its request travels on the same (sender, receiver, tag) pair as the node's messages to the server,
which torch.distributed keeps in order, so a read sees every message the reading node sent before it.

Reads are not counted as bytes (the node's or the server's), as on the sim: they observe, as validation does.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from exogym.backends.server_state import load_server, server_state
from exogym.comm.messages import Server

__all__ = ["ReadRequest", "encode_state", "decode_state", "load_answer"]


@dataclass(frozen=True)
class ReadRequest:
    """A read of node `rank`, its `number`-th, which holds the server's first `known` update rows."""

    rank: int
    number: int
    known: int

    def describe(self) -> str:
        """In words, for an error or the server watch."""
        return f"read_server request #{self.number} from node {self.rank}"


def encode_state(server: Server, since: int) -> torch.Tensor:
    """The server's state (update rows from row `since` on) as bytes in a uint8 tensor, for the wire."""
    buffer = io.BytesIO()
    torch.save(server_state(server, since=since), buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode_state(payload: torch.Tensor) -> dict[str, Any]:
    """What encode_state sent (tensors on the CPU, as a message's)."""
    return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=False)


def load_answer(shadow: Server, state: dict[str, Any], known: int) -> None:
    """Load an answer into the shadow: its rows up to `known` (the ones the request said it held), then the new."""
    load_server(shadow, {**state, "updates": shadow.updates[:known] + state["updates"]})
