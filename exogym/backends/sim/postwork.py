"""The handles a sim node's `isend` and `irecv` return (torch.distributed's Work): waiting on one moves the node's
clock as the message's arrival says."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from exogym.cluster.network import SERVER
from exogym.comm.messages import Message

if TYPE_CHECKING:
    from exogym.backends.sim.baton import Baton
    from exogym.cluster.simtime import NodeClock
    from exogym.comm.transport import CommStats

__all__ = ["SimSendWork", "SimRecvWork"]


class Receiver(Protocol):
    """The node an irecv belongs to (its transport): what waiting on the handle reads and moves."""

    rank: int
    step: int | None
    clock: "NodeClock"
    stats: "CommStats"
    baton: "Baton"


class SimSendWork:
    """isend's handle: wait() brings the sender's clock to the message's arrival (the transfer is communication,
    waiting for a shared link included). `until_sent()` returns once the arrival is known (shared links: when the
    message's flow ends)."""

    def __init__(self, clock: "NodeClock", message: Message, until_sent: Callable[[], None]):
        self._clock, self._message, self._until_sent, self._done = clock, message, until_sent, False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._until_sent()
            self._done = True
            self._clock.transfer_until(self._message.arrives_at)
        return True


class SimRecvWork:
    """irecv's handle: wait() takes the message (in arrival order) and returns it."""

    def __init__(self, transport: "Receiver", src: int | None, tag: int | None, into: torch.Tensor | None):
        self._t, self._src, self._tag, self._into = transport, src, tag, into
        self._message: Message | None = None

    def is_completed(self) -> bool:
        return self._message is not None

    def wait(self, timeout: Any = None) -> Message:
        if self._message is not None:
            return self._message
        t, post = self._t, self._t.baton.messages
        who = "any node" if self._src is None else "the server" if self._src == SERVER else f"node {self._src}"
        m = post.receive(t.rank, t.clock.now, self._src, self._tag, lambda: (
            f"recv from {who}" + ("" if self._tag is None else f" with tag {self._tag}")
            + f" at step {t.step}, since {t.clock.now:.6g} s"))
        t.clock.catch_up(m.arrives_at)  # waited for it: idle
        t.stats.bytes_received += m.nbytes
        if self._into is not None:
            self._into.copy_(m.tensor)
        self._message = m
        return m
