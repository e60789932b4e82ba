"""The torch backend's watch on a strategy's server: a handler that never returns ends the run as stuck, naming the
server and the message it was handling, within node_timeout.

The server runs on a thread of rank 0's process (exogym.backends.torch.messages). Its post office notes the item
each handler runs (`handling`: the message or timer and when it began). A thread here samples that note every
min(1 s, timeout / 10); when one item has been handled for `timeout` seconds, it builds a ServerTimeoutError (the
server's class, the message, the handler thread's Python stack) and fails the post office with it, so node 0's
next message call, or its wait in one, raises it (within a second: those waits wake every second). The nodes that
wait for the server's answer wait node_timeout plus `grace` (`wait_grace`) before they give up, so the server is
named first, not the first node that waited for it; node 0 in a collective that timed out (its members wait for the
server) asks the watch for its verdict (`verdict`) and raises the server's error. A Python thread cannot be stopped from outside: the stuck
handler's thread stays, and the run's processes are ended by the launcher as for any failure.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Any

from exogym.backends.errors import ServerTimeoutError

__all__ = ["ServerWatch", "wait_grace"]


def wait_grace(timeout_s: float) -> float:
    """How much longer than node_timeout a node waits in a recv, so that a stuck server is named first."""
    return max(5.0, timeout_s / 2)


class ServerWatch:
    """Watches `post.handling` (None, or (item, monotonic start)) from a thread; `start` and `stop` it.

    Args:
        post: The post office holding the server (rank 0's), with `handling`, `server` and `fail(error)`.
        timeout_s: How long one handler may run (fit's node_timeout).
    """

    def __init__(self, post: Any, timeout_s: float):
        self.post, self.timeout_s = post, timeout_s
        self.error: ServerTimeoutError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="exogym-server-watch", daemon=True)

    def start(self) -> "ServerWatch":
        """Start watching.

        Returns:
            Itself.
        """
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the run's messages are over)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def verdict(self, post: Any) -> ServerTimeoutError | None:
        """The watch's error once it is decided: while a handler still runs, wait until it returns (None) or the
        watch fires (at most node_timeout and one sample period after it began).

        Args:
            post: The post office watched.

        Returns:
            The ServerTimeoutError, or None when the server is not stuck.
        """
        while self.error is None and post.handling is not None and self._thread.is_alive():
            time.sleep(0.05)
        return self.error

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(period):
            handling = self.post.handling
            if handling is not None and time.monotonic() - handling[1] >= self.timeout_s:
                self._fire(handling[0], time.monotonic() - handling[1])
                return

    def _fire(self, item: Any, held_s: float) -> None:
        server = type(self.post.server).__name__
        what = item.describe() if hasattr(item, "describe") else f"its timer at {item[1]:.6g} s"
        stack = _stack_of("exogym-server")
        self.error = ServerTimeoutError(
            f"the server ({server}) ran for {held_s:.1f} s handling {what} without returning, longer than "
            f"node_timeout={self.timeout_s:g} s, so the run was stopped; its thread was here:\n{stack.rstrip()}\n"
            "A server's receive or wake that never returns holds every node up forever. If it really takes this "
            "long, pass fit(node_timeout=<seconds>) or node_timeout=None.", server, what)
        self.post.fail(self.error)


def _stack_of(name: str) -> str:
    """The Python stack of the thread called `name`, or a note that it cannot be read."""
    thread = next((t for t in threading.enumerate() if t.name == name), None)
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    return "".join(traceback.format_stack(frame)[-25:]) if frame is not None else "  (not available)\n"
