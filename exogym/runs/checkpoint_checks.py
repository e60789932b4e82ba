"""What a checkpoint's files hold, checked against the run before any node starts.

The sha256 in the manifest says a file is the one written; it says nothing of a file changed and its hash written
again, or of a bug that saved something wrong. So what the nodes would trust blindly is checked here, each failure a
CheckpointError naming the file and the field: the random streams' shapes (Python's, numpy's, torch's), the clock
and byte counts (finite, not negative), and node 0's messages in flight (exogym.backends.sim.postoffice's state):
every sender and receiver a node of the run or the server, times finite and not negative with no message arriving
before it was sent, counts and orders whole numbers, every mailbox holding only its node's messages, the server's
clock and rows. The server's tensors are checked against the server the run makes (their shapes), where it is made
(`check_server_state`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from exogym.cluster.network import SERVER

__all__ = ["CheckpointError", "check_node_state", "check_messages_state", "check_server_state"]


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupted, or from a different run configuration."""

_ROW_KEYS = ("step", "lr", "bytes", "wall_time_s")  # what every training row holds (exogym.runs.record)
_CLOCK_SECONDS = ("now", "compute_s", "comm_s", "wait_s", "slowed_s")  # a node clock's times (NodeClock)
_MT_WORDS = 624  # the Mersenne Twister's state: 624 words and a position (Python's random, numpy's RandomState)


class _Bad(Exception):
    """A field that does not hold what the run wrote there: (field, why)."""


def _fail(field: str, why: str) -> None:
    raise _Bad(field, why)


def _int(field: str, value: Any, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        _fail(field, f"a whole number {'>= ' + str(low) if high is None else f'in {low}..{high}'} expected, got "
                     f"{_short(value)}")
    return value


def _time(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        _fail(field, f"a finite, non-negative number of seconds expected, got {_short(value)}")
    return float(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _raise(file: Path, error: _Bad) -> None:
    field, why = error.args
    raise CheckpointError(f"checkpoint file {str(file)!r}: {field} does not hold what this run writes there ({why}); "
                          f"the file was changed after it was written: resume from an earlier checkpoint in "
                          f"{str(file.parent.parent)!r}") from None


def check_node_state(plain: Mapping[str, Any], num_nodes: int, file: Path) -> None:
    """A node's state as torch.load read it: its random streams, clock, counts and (node 0) messages.

    Args:
        plain: What the node's file holds.
        num_nodes: The run's node count.
        file: The node's file (named in errors).

    Raises:
        CheckpointError: A field that cannot be this run's, named.
    """
    def clock() -> None:
        for name in _CLOCK_SECONDS:
            if name in plain["clock"]:
                _time(f"clock.{name}", plain["clock"][name])

    def counts() -> None:
        for name in ("bytes_sent", "payload_bytes", "bytes_received"):
            _int(f"comm_stats.{name}", plain["comm_stats"].get(name, 0))

    def messages() -> None:
        strategy = plain["strategy"]
        if isinstance(strategy, Mapping) and strategy.get("messages") is not None:
            check_messages_state(strategy["messages"], num_nodes)

    def rows() -> None:  # the rows a resumed run writes back and merges into its record
        for i, row in enumerate(plain["log"]["rows"]):
            missing = [k for k in _ROW_KEYS if k not in row]
            if missing or not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in row.items()):
                _fail(f"log.rows[{i}]", f"a row of numbers with {list(_ROW_KEYS)} expected, got {_short(row)}")
            _int(f"log.rows[{i}].step", int(row["step"]) if row["step"] == int(row["step"]) else row["step"], 1)

    parts = (("step", lambda: _int("step", plain["step"])), ("rng", lambda: _check_rng(plain["rng"])),
             ("clock", clock), ("comm_stats", counts), ("log", rows), ("messages", messages))
    for name, check in parts:
        try:
            check()
        except _Bad as e:
            _raise(file, e)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:  # a key or a shape gone
            _raise(file, _Bad(name, f"{type(e).__name__}: {e}"))


def _check_rng(rng: Mapping[str, Any]) -> None:
    torch_cpu = rng["torch_cpu"]
    if not isinstance(torch_cpu, torch.Tensor) or torch_cpu.dtype != torch.uint8 or torch_cpu.dim() != 1:
        _fail("rng.torch_cpu", f"torch's generator state (a 1-D uint8 tensor) expected, got {_short(torch_cpu)}")
    version, internal, gauss = rng["python"]
    _int("rng.python version", version, 1, 3)
    if not isinstance(internal, (list, tuple)) or len(internal) != _MT_WORDS + 1:
        _fail("rng.python", f"{_MT_WORDS + 1} words expected, got {_short(internal)}")
    for i, word in enumerate(internal[:-1]):
        _int(f"rng.python[{i}]", word, 0, 2**32 - 1)
    _int("rng.python position", internal[-1], 0, _MT_WORDS)
    if gauss is not None and (not isinstance(gauss, float) or not math.isfinite(gauss)):
        _fail("rng.python gauss", f"None or a finite float expected, got {_short(gauss)}")
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    if kind != "MT19937":
        _fail("rng.numpy", f"'MT19937' expected, got {_short(kind)}")
    if not isinstance(keys, torch.Tensor) or tuple(keys.shape) != (_MT_WORDS,) or \
            (keys.numel() and (int(keys.min()) < 0 or int(keys.max()) > 2**32 - 1)):
        _fail("rng.numpy keys", f"{_MT_WORDS} words expected, got {_short(keys)}")
    _int("rng.numpy position", pos, 0, _MT_WORDS)
    _int("rng.numpy has_gauss", has_gauss, 0, 1)
    if not isinstance(cached, float) or not math.isfinite(cached):
        _fail("rng.numpy cached gauss", f"a finite float expected, got {_short(cached)}")
    cuda = rng.get("cuda")
    if cuda is not None and (not isinstance(cuda, torch.Tensor) or cuda.dtype != torch.uint8 or cuda.dim() != 1):
        _fail("rng.cuda", f"CUDA's generator state (a 1-D uint8 tensor) expected, got {_short(cuda)}")


def check_messages_state(state: Mapping[str, Any], num_nodes: int) -> None:
    """The messages in flight, the mailboxes, the senders' counts and the server's plain state (node 0's file).

    Raises:
        _Bad: The first field that cannot be this run's (check_node_state names the file).
    """
    order = _int("messages.order", state["order"], -1)
    seen: set[int] = set()
    for i, event in enumerate(state["events"]):
        where = f"messages.events[{i}]"
        o = _int(f"{where}.order", event["order"], 0, order)
        if o in seen:
            _fail(f"{where}.order", f"order {o} is taken by another event")
        seen.add(o)
        if "wake" in event:
            _time(f"{where}.wake", event["wake"])
        elif "finish" in event:  # a transfer on shared links ends (exogym.cluster.flows)
            _time(f"{where}.finish", event["finish"])
            if not isinstance(event["key"], (list, tuple)) or len(event["key"]) != 2:
                _fail(f"{where}.key", f"(sender, count) expected, got {_short(event['key'])}")
            _party(f"{where}.key[0]", event["key"][0], num_nodes)
            _int(f"{where}.key[1]", event["key"][1])
            _int(f"{where}.version", event["version"])
        else:  # a message on the wire; one starting on shared links has no arrival time yet (nan)
            _check_message(f"{where}.message", event["message"], num_nodes, on_the_wire=bool(event.get("start")))
    for src, count in state["sent"].items():
        _party(f"messages.sent (sender {_short(src)})", src, num_nodes)
        _int(f"messages.sent[{src}]", count)
    _int("messages.handled", state["handled"])
    for rank, box in state["mail"].items():
        r = _int(f"messages.mail (node {_short(rank)})", int(rank) if isinstance(rank, str) and rank.isdigit()
                 else rank, 0, num_nodes - 1)
        for j, m in enumerate(box):
            _check_message(f"messages.mail[{r}][{j}]", m, num_nodes)
            if m["dst"] != r:
                _fail(f"messages.mail[{r}][{j}].dst", f"node {r}'s mailbox holds a message to {m['dst']!r}")
    server = state["server"]
    if server is not None:
        _time("messages.server.now", server["now"])
        if not isinstance(server["updates"], list) or not all(isinstance(u, Mapping) for u in server["updates"]):
            _fail("messages.server.updates", f"a list of rows expected, got {_short(server['updates'])}")
        for name, value in server["stats"].items():
            _int(f"messages.server.stats.{name}", value)


def _party(field: str, who: Any, num_nodes: int) -> int:
    """A sender or receiver: a node of the run, or the server."""
    if isinstance(who, bool) or not isinstance(who, int) or not (who == SERVER or 0 <= who < num_nodes):
        _fail(field, f"a node of the run (0..{num_nodes - 1}) or the server ({SERVER}) expected, got {_short(who)}")
    return who


def _check_message(where: str, m: Mapping[str, Any], num_nodes: int, on_the_wire: bool = False) -> None:
    src, dst = _party(f"{where}.src", m["src"], num_nodes), _party(f"{where}.dst", m["dst"], num_nodes)
    if src == dst:
        _fail(f"{where}.dst", f"a message from {src} to itself")
    if not isinstance(m["tensor"], torch.Tensor) or m["tensor"].layout != torch.strided:
        _fail(f"{where}.tensor", f"a dense tensor expected, got {_short(m['tensor'])}")
    _int(f"{where}.tag", m["tag"], -2**63)
    if not isinstance(m["meta"], Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in m["meta"].items()):
        _fail(f"{where}.meta", f"str -> number expected, got {_short(m['meta'])}")
    sent = _time(f"{where}.sent_at", m["sent_at"])
    if on_the_wire and isinstance(m["arrives_at"], float) and math.isnan(m["arrives_at"]):
        arrives = sent  # its arrival is known once its flow ends
    else:
        arrives = _time(f"{where}.arrives_at", m["arrives_at"])
    if arrives < sent:
        _fail(f"{where}.arrives_at", f"it arrives at {arrives!r} s, before it was sent at {sent!r} s")
    _int(f"{where}.seq", m["seq"])


def check_server_state(fresh: Mapping[str, Any], saved: Mapping[str, Any], where: str = "state") -> None:
    """A checkpoint's server state (its `state_dict()`) against that of the server the run just made: the same keys
    and, for every tensor, the same shape and dtype.

    Args:
        fresh: The new server's state_dict().
        saved: The checkpoint's.
        where: The field's name so far (for the error).

    Raises:
        CheckpointError: A key missing or added, or a tensor of another shape or dtype, named.
    """
    if isinstance(fresh, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != fresh.shape or saved.dtype != fresh.dtype:
            got = f"{tuple(saved.shape)} {saved.dtype}" if isinstance(saved, torch.Tensor) else _short(saved)
            raise CheckpointError(f"the checkpoint's server {where} holds {got} where this run's server has a "
                                  f"{tuple(fresh.shape)} {fresh.dtype} tensor: the file was changed after it was "
                                  "written, or is another run's; resume from an earlier checkpoint")
        return
    if isinstance(fresh, Mapping):
        if not isinstance(saved, Mapping) or set(map(str, saved)) != set(map(str, fresh)) and \
                any(isinstance(v, torch.Tensor) for v in fresh.values()):
            raise CheckpointError(f"the checkpoint's server {where} holds {_short(saved)} where this run's server has "
                                  f"the fields {sorted(map(str, fresh))}: resume from an earlier checkpoint")
        for key, value in fresh.items():
            if key in saved:
                check_server_state(value, saved[key], f"{where}.{key}")
