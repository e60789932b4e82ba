"""The run's server on the sim, where it runs (one process, or the keeper): made once, run between the nodes' turns at
each message's arrival time and at its timers, named while a handler runs (for the watchdog), and its state as plain
data (a checkpoint's, and what a node in another process reads into its shadow: `server_state`, `load_server`, from
exogym.backends.server_state, which the torch backend shares)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from exogym.backends.server_state import load_server, server_state
from exogym.comm.messages import Message, Server, ServerPost, attach_server
from exogym.runs.checkpoint_checks import check_server_state
from exogym.comm.transport import MessageError

__all__ = ["ServerHost", "server_state", "load_server"]


class ServerHost:
    """The server a strategy declared (None until one is), the messages it has handled, and what it is handling."""

    def __init__(self) -> None:
        self.server: Server | None = None
        self.handled = 0  # messages the server has handled
        self._handling: Callable[[], str] | None = None  # what a handler runs for, in words once asked (the watchdog)
        self._saved: dict[str, Any] | None = None  # a checkpoint's server state, until the server is made

    def serve(self, make: Callable[[], Server], post: ServerPost) -> Server:
        """The server, made by `make()` at the first call and tied to `post` (its messages and timers go there)."""
        if self.server is None:
            self.server = attach_server(make, post)
            if self._saved is not None:  # a checkpoint read before the server was made
                check_server_state(self.server.state_dict(), self._saved["state"])  # its tensors' shapes
                load_server(self.server, self._saved)
                self._saved = None
        return self.server

    def handle(self, message: Message) -> None:
        """The server takes `message`, at its arrival time.

        Raises:
            MessageError: the run has no server, or it raised.
        """
        if self.server is None:
            raise MessageError(f"{message.describe()}: the run has no server (a strategy declares one with "
                               "exogym.comm.serve in its setup)")
        self.server.stats.bytes_received += message.nbytes
        number = self.handled + 1
        self.run(lambda: f"{message.describe()} (message {number} it handled)", message.arrives_at,
                 lambda s: s.receive(message))
        self.handled += 1

    def run(self, what: Callable[[], str], at: float, call: Callable[[Server], None]) -> None:
        """`call(server)` at simulated time `at` (`what()`: the handler in words, for an error or the watchdog; put
        in words only when asked, since most handlers return at once).

        Raises:
            MessageError: the server raised.
        """
        server = self.server
        server.now = at
        self._handling = what  # a handler that never returns is named by the watchdog
        try:
            with torch.no_grad():
                call(server)
        except Exception as e:
            raise MessageError(f"the server ({type(server).__name__}) raised while handling {what()}: "
                               f"{type(e).__name__}: {e}") from e
        finally:
            self._handling = None

    @property
    def handling(self) -> tuple[str, str] | None:
        """(the server's class, what it handles) while a handler runs (read from the watchdog's thread)."""
        what = self._handling
        return None if what is None else (type(self.server).__name__, what())

    # ---- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any] | None:
        """The server's state (None without a server)."""
        if self.server is None:
            return None
        return {**server_state(self.server), "sent": self.server.sent_log.to_plain()["messages"]}  # the timeline's

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Restore what state_dict returned; a server not yet made takes it when it is made."""
        if saved is None:
            return
        if self.server is None:
            self._saved = saved
        else:
            check_server_state(self.server.state_dict(), saved["state"])
            load_server(self.server, saved)

    def check_loaded(self) -> None:
        """After node 0's start: a checkpoint's server state found its server.

        Raises:
            RuntimeError: the checkpoint holds a server's state but the run's strategy declared none.
        """
        if self._saved is not None:
            raise RuntimeError("the checkpoint holds a server's state but this run's strategy declares none")
