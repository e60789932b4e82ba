"""The nodes' mailboxes on the sim: the messages that have arrived for each node, in arrival order, and what each
node waiting in a `recv` waits for."""

from __future__ import annotations

from typing import Any

from exogym.backends.sim.events import message_from_plain, message_plain
from exogym.comm.messages import Message

__all__ = ["Mailboxes", "Want"]

Want = tuple[int | None, int | None, str]  # (src, tag, what): the sender and tag waited for (None: any), in words


class Mailboxes:
    """Every node's arrived messages (the queue's order) and the recvs waiting for one."""

    def __init__(self, num_nodes: int):
        self._mail: dict[int, list[Message]] = {r: [] for r in range(num_nodes)}
        self._wants: dict[int, Want] = {}  # rank -> (src, tag, what) it waits for

    def deliver(self, message: Message) -> Want | None:
        """Into its receiver's mailbox; returns what the receiver waited for, if this message matches it (the
        receiver no longer waits: it is to be woken)."""
        self._mail[message.dst].append(message)  # arrival order: the queue's order
        want = self._wants.get(message.dst)
        if want is not None and matches(message, want[0], want[1]):
            del self._wants[message.dst]
            return want
        return None

    def first(self, rank: int, src: int | None, tag: int | None) -> Message | None:
        """Take the first message for `rank` from `src` with `tag`, if one has arrived."""
        box = self._mail[rank]
        for i, m in enumerate(box):
            if matches(m, src, tag):
                return box.pop(i)
        return None

    def take_arrived(self, rank: int, src: int | None, tag: int | None) -> list[Message]:
        """Take every message for `rank` from `src` with `tag` that has arrived."""
        box = self._mail[rank]
        taken = [m for m in box if matches(m, src, tag)]
        self._mail[rank] = [m for m in box if not matches(m, src, tag)]
        return taken

    def wait(self, rank: int, src: int | None, tag: int | None, what: str) -> None:
        """Node `rank` waits for a message from `src` with `tag` (`what`: the wait in words)."""
        self._wants[rank] = (src, tag, what)

    def wants(self) -> dict[int, Want]:
        """Rank -> (src, tag, what) of every node waiting in a recv."""
        return dict(self._wants)

    def state_dict(self) -> dict[int, list[dict[str, Any]]]:
        """Each node's arrived messages, as plain data (no node waits at a checkpoint's pause)."""
        return {r: [message_plain(m) for m in box] for r, box in self._mail.items()}

    def load_state_dict(self, mail: dict[Any, list[dict[str, Any]]]) -> None:
        """Restore what state_dict returned."""
        self._mail = {int(r): [message_from_plain(m) for m in box] for r, box in mail.items()}


def matches(m: Message, src: int | None, tag: int | None) -> bool:
    """Whether message `m` is from `src` with `tag` (None: any)."""
    return (src is None or m.src == src) and (tag is None or m.tag == tag)
