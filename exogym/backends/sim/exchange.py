"""Collectives whose members live in several processes: fit(processes=P), or torchrun with backend="sim".

Each process runs the sim over its own block of nodes. A collective's local members meet as in one process; once
the last of them has arrived, the process sends its part (exogym.backends.sim.collective_parts) to the group's leader, the
lowest process holding a member, with torch.distributed point-to-point messages (gloo, through host memory), and
the leader sends every other holder its reply. Each message carries a header first: the collective's identity
(its group and sequence number), its signature and, per local member, its rank, step, arrival time and whether
it blocks, so the leader checks the members agree (a mismatch is a CollectiveError naming the nodes) and settles
the simulated time exactly as one process would.

Why this cannot deadlock where one process would not. Nothing a process does for a crossing blocks: every send
and receive is posted at once (isend/irecv), a small thread per receive waits on it and reports to the process's
queue, and the process goes on running whichever of its nodes can run. A node waiting on a crossing is blocked
like one waiting on a local collective; the process's other nodes keep running and reach the collectives they owe
to third processes (islands straddling processes in a ring included). The leader replies as soon as the last
part arrives, whatever its own nodes are doing. So a collective completes once every member has called it, as in
one process; and if some never will, every process ends up waiting with nothing to run: each then says so in
the run's store, and once all of them have said so twice, a second apart, with nothing changed and no packet of the
message link in flight (`in_flight`: exogym.backends.sim.postlink), every process raises a CollectiveError naming
what each node waits for.
"""

from __future__ import annotations

import hashlib
import pickle
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from exogym.backends.sim.baton import CollectiveCall, Pending
from exogym.backends.sim.collective_parts import OPS
from exogym.backends.sim.protocols import Packets
from exogym.backends.peer_watch import PeerWatch
from exogym.comm.transport import CollectiveError

__all__ = ["Exchange", "Crossing", "in_flight"]

_CONFIRM_S = 1.0  # and a deadlock is declared when every process has told so twice, this far apart


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (gloo moves any dtype that way)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _float_bits(x: float) -> int:
    return int(torch.tensor(x, dtype=torch.float64).view(torch.int64))


def _bits_float(i: int) -> float:
    return float(torch.tensor(i, dtype=torch.int64).view(torch.float64))


@dataclass
class Crossing:
    """One collective on its way across processes (this process's side)."""

    pending: Pending
    calls: list[CollectiveCall]  # this process's members', in rank order
    op: str
    group: tuple[int, ...]
    holders: list[int]  # processes holding members, ascending
    members: dict[int, list[int]]  # holder -> its member ranks
    key: int
    finish: Callable[[list[CollectiveCall], float], None]  # results delivered: (local calls, the last arrival)
    headers: dict[int, torch.Tensor] = field(default_factory=dict)  # leader: holder -> header received
    parts: dict[int, torch.Tensor | None] = field(default_factory=dict)  # leader: holder -> its part (None: none)
    checked: bool = False  # leader: every header is in and agrees
    reply: torch.Tensor | None = None  # non-leader: its reply's header and data buffers
    reply_data: torch.Tensor | None = None
    waiting: int = 0  # receives outstanding
    sends: list = field(default_factory=list)  # posted sends, kept alive until the crossing completes

    @property
    def leader(self) -> int:
        return self.holders[0]


class Exchange:
    """This process's crossings; `owner[r]` is node r's process, `me` this one."""

    def __init__(self, owner: Sequence[int], me: int, store: Any, run_key: str, peer_timeout: float | None = None):
        self.owner, self.me, self.store, self.run_key = list(owner), me, store, run_key
        self.peers = PeerWatch(store, run_key, me, self.owner, peer_timeout)
        self.processes = max(self.owner) + 1
        self._crossings: dict[int, Crossing] = {}
        self._events: queue.Queue = queue.Queue()
        self.completed = 0  # crossings done (progress, for the deadlock check)

    # ---- starting ---------------------------------------------------------------------------------------------
    def start(self, pending: Pending, calls: list[CollectiveCall], op: str,
              finish: Callable[[list[CollectiveCall], float], None]) -> None:
        """The last local member arrived: send this process's part (or, as leader, wait for the others')."""
        members: dict[int, list[int]] = {}
        for r in pending.group:
            members.setdefault(self.owner[r], []).append(r)
        holders = sorted(members)
        key = _hash(pending.group, pending.seq)
        x = Crossing(pending, calls, op, pending.group, holders, members, key, finish)
        self._crossings[key] = x
        header = self._header(x)
        if self.me == x.leader:
            x.headers[self.me] = header
            for h in holders[1:]:
                self._recv(x, torch.empty_like(header), h, phase=0, into=("header", h))
            self._advance(x)
            return
        x.sends.append(dist.isend(header, x.leader, tag=self._tag(key, 0)))
        part = OPS[op].part(calls)
        if part is not None:
            x.sends.append(dist.isend(_bytes(part), x.leader, tag=self._tag(key, 1)))
        x.reply = torch.empty(3, dtype=torch.int64)
        self._recv(x, x.reply, x.leader, phase=2, into=("reply", None))
        x.reply_data = OPS[op].reply_like(calls, pending.group)  # shaped as the op says for this holder
        if x.reply_data is not None:
            self._recv(x, _bytes(x.reply_data), x.leader, phase=3, into=("reply_data", None))

    def _header(self, x: Crossing) -> torch.Tensor:
        """[key, signature, members here, steps must match, then rank, step, arrival, blocking per member]."""
        first = x.calls[0]
        h = torch.zeros(4 + 4 * len(x.group), dtype=torch.int64)
        h[:4] = torch.tensor([x.key, _hash(first.signature), len(x.calls), int(first.match_step)])
        for i, c in enumerate(x.calls):
            h[4 + 4 * i: 8 + 4 * i] = torch.tensor([c.args["rank"], -1 if c.step is None else c.step,
                                                    _float_bits(c.args["arrival"]), int(c.blocking)])
        return h

    def _tag(self, key: int, phase: int) -> int:
        # gloo's tags are 32-bit: 28 bits of the key. Two crossings between the same two processes with the same
        # tag at the same time are matched in posting order; the header's full key check turns a mix-up into an
        # error, never into wrong data.
        return ((key & ((1 << 28) - 1)) << 2) | phase

    def _recv(self, x: Crossing, buffer: torch.Tensor, src: int, *, phase: int, into: tuple) -> None:
        work = dist.irecv(buffer, src, tag=self._tag(x.key, phase))
        x.waiting += 1

        def wait() -> None:  # gloo says a receive is complete only once someone waits on it
            try:
                work.wait()
                self._events.put((x.key, into, buffer, None))
            except BaseException as e:  # noqa: BLE001 - reported to the process's own thread
                self._events.put((x.key, into, buffer, (src, e)))

        threading.Thread(target=wait, name="exogym-exchange", daemon=True).start()

    # ---- progress ---------------------------------------------------------------------------------------------
    def notify(self, handle: Callable[[], None]) -> None:
        """Have `handle()` run on the process's own thread at its next wait (from any thread): how another channel
        between the processes (exogym.backends.sim.postlink) wakes the process that waits here."""
        self._events.put(handle)

    def has_news(self) -> bool:
        """Whether something waits to be handled at the next `wait` (a message, another channel's packet)."""
        return not self._events.empty()

    @property
    def busy(self) -> bool:
        return bool(self._crossings)

    def wait(self, timeout: float) -> list[Pending]:
        """Wait up to `timeout` s for messages; return the collectives that completed (their members run again)."""
        done: list[Pending] = []
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return done
        while True:
            if callable(event):  # another channel's news (a message link's packet): handled here, on this thread
                event()
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    return done
                continue
            key, into, buffer, error = event
            if error is not None:
                src, cause = error
                raise self.peers.lost(src, cause) from cause
            x = self._crossings[key]
            x.waiting -= 1
            kind, holder = into
            if kind == "header":
                x.headers[holder] = buffer  # parts and replies land in their tensors' own bytes
            if self._advance(x):
                done.append(x.pending)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return done

    def _advance(self, x: Crossing) -> bool:
        """Move a crossing on after a message; True once it completed here."""
        if self.me == x.leader:
            return self._advance_leader(x)
        if x.waiting:
            return False
        key, status, start = x.reply.tolist()
        if key != x.key:
            raise CollectiveError(f"cross-process message mix-up on group {list(x.group)} (a tag collision); rerun")
        if status:
            raise CollectiveError(pickle.loads(self.store.get(f"{self.run_key}/error/{x.key}")))
        OPS[x.op].deliver(x.calls, x.reply_data, 0)
        self._complete(x, _bits_float(start))
        return True

    def _advance_leader(self, x: Crossing) -> bool:
        if len(x.headers) < len(x.holders):
            return False
        if not x.checked:  # every header is in: check them, then take the parts (received in place)
            self._check(x)
            x.checked = True
            x.parts[self.me] = OPS[x.op].part(x.calls)
            for h in x.holders[1:]:
                x.parts[h] = OPS[x.op].part_like(x.calls, x.members[h])
                if x.parts[h] is not None:
                    self._recv(x, _bytes(x.parts[h]), h, phase=1, into=("part", h))
        if x.waiting:
            return False
        parts = [x.parts[h] for h in x.holders]
        counts = [len(x.members[h]) for h in x.holders]
        replies = OPS[x.op].combine(x.calls, parts, counts, x.group)
        start = max(_bits_float(v) for h in x.holders for v in self._arrivals(x.headers[h]))
        for h, reply in zip(x.holders[1:], replies[1:]):
            x.sends.append(dist.isend(torch.tensor([x.key, 0, _float_bits(start)]), h, tag=self._tag(x.key, 2)))
            if reply is not None:  # every holder posted a receive for it (start): all ops but the barrier
                x.sends.append(dist.isend(_bytes(reply), h, tag=self._tag(x.key, 3)))
        OPS[x.op].deliver(x.calls, replies[0], 0)
        self._complete(x, start)
        return True

    def _arrivals(self, header: torch.Tensor) -> list[int]:
        n = int(header[2])
        return [int(header[6 + 4 * i]) for i in range(n)]

    def _check(self, x: Crossing) -> None:
        """The members agree on the collective (signature, key) and, where the strategy says so, the step."""
        mine = x.headers[self.me]
        for h in x.holders[1:]:
            theirs = x.headers[h]
            problem = None
            if int(theirs[0]) != x.key:
                problem = "a cross-process message mix-up (a tag collision); rerun"
            elif int(theirs[1]) != int(mine[1]):
                problem = (f"mismatched collective #{x.pending.seq} on group {list(x.group)}: node {x.calls[0].args['rank']} "
                           f"(step {x.calls[0].step}) called {x.calls[0].describe()}, node {int(theirs[4])} (step "
                           f"{int(theirs[5])}) called another collective or shape (in another process)")
            elif int(theirs[3]) and int(mine[3]) and int(theirs[5]) != int(mine[5]):
                problem = (f"collective #{x.pending.seq} on group {list(x.group)} paired calls from different steps: "
                           f"node {int(mine[4])} called {x.calls[0].describe()} at step {int(mine[5])}, node "
                           f"{int(theirs[4])} at step {int(theirs[5])}; every member must make the same collectives "
                           "at the same step (one of them skipped or repeated a call). A strategy whose nodes meet "
                           "at different steps on purpose sets the class attribute collectives_match_steps = False")
            if problem is not None:
                self.store.set(f"{self.run_key}/error/{x.key}", pickle.dumps(problem))
                for other in x.holders[1:]:
                    x.sends.append(dist.isend(torch.tensor([x.key, 1, 0]), other, tag=self._tag(x.key, 2)))
                raise CollectiveError(problem)

    def _complete(self, x: Crossing, start: float) -> None:
        for w in x.sends:  # the receivers have them by now (replies follow parts); frees the buffers
            w.wait()
        del self._crossings[x.key]
        self.completed += 1
        x.finish(x.calls, start)

    # ---- deadlock ---------------------------------------------------------------------------------------------
    def report_stall(self, description: str, progress: int, packets: "Packets | None" = None) -> str | None:
        """This process has nothing to run; None while others still may, else every process's description.

        Args:
            description: what this process's nodes wait for, one line each.
            progress: events this process has seen happen so far (collectives entered and completed, answers).
            packets: the message link's packets this process sent to each process and took in from each
                (exogym.backends.sim.postlink.Link.counts); None without a link.

        Returns:
            None, or (a deadlock: every process has said so twice, `_CONFIRM_S` apart, with nothing changed and no
            packet of the link in flight) every process's description.
        """
        self.store.set(f"{self.run_key}/stall/{self.me}", pickle.dumps((progress, description, packets)))
        first = self._stalls()
        if first is None or in_flight(first):
            return None
        time.sleep(_CONFIRM_S)
        second = self._stalls()
        if second != first:
            return None
        return "\n".join(f"process {p}:\n{desc}" for p, (_, desc, _) in sorted(second.items()) if desc)

    def report_running(self) -> None:
        self.store.set(f"{self.run_key}/stall/{self.me}", pickle.dumps(None))

    def report_finished(self) -> None:
        self.store.set(f"{self.run_key}/stall/{self.me}", pickle.dumps((-1, "", None)))
        self.peers.finished()

    def check_peers(self) -> None:
        """Raise PeerLostError when a process this one may wait for stopped responding (exogym.backends.peer_watch)."""
        self.peers.check()

    def close(self) -> None:
        """The run stopped in this process: its heartbeat stops."""
        self.peers.close()

    def _stalls(self) -> dict[int, tuple[int, str, "Packets | None"]] | None:
        keys = [f"{self.run_key}/stall/{p}" for p in range(self.processes)]
        if not self.store.check(keys):
            return None
        states = {p: pickle.loads(self.store.get(k)) for p, k in enumerate(keys)}
        return None if any(s is None for s in states.values()) else states


def in_flight(stalls: dict[int, tuple[int, str, Packets | None]]) -> bool:
    """Whether a packet of the message link is on its way: some process sent another more packets than that one has
    taken in. Such a packet (an answer, a status, a question) wakes its receiver or lets the keeper go on, however
    long it takes to arrive on a loaded machine, so every process waiting is no deadlock yet. A process that
    finished (no counts) took in every packet sent to it before its goodbye."""
    for p, (_, _, packets) in stalls.items():
        if packets is None:
            continue
        for q, sent in packets[0].items():
            theirs = stalls.get(q, (0, "", None))[2]
            if theirs is not None and theirs[1].get(p, 0) != sent:
                return True
    return False
