"""The marker file `.exogym-run`: what it says, how it is written atomically and read, whether its holder still
runs, and how it is described.

A marker says who holds its folder (run id, process id, host, when it started) and whether that run is still
running, and, once it ended, how ("completed", "failed" with the reason); a checkpoint folder's marker also says
"kind": "checkpoints". It is created with O_CREAT | O_EXCL (`create_marker`): of two runs creating one, exactly one
succeeds, which is how exogym.runs.folder claims folders. It is replaced atomically (`rewrite_marker`, which falls
back to rewriting it in place on a full disk: it stays within one block), and taken over from a run that ended
only if it still says what was read (`take_over`), so two racers never both hold it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import uuid
from pathlib import Path

from exogym.runs.disk import disk_full

__all__ = ["MARKER", "marker_text", "create_marker", "rewrite_marker", "take_over", "read_marker_text", "parse_marker",
           "read_marker", "holder_running", "describe_marker", "describe_holder", "write_all"]

MARKER = ".exogym-run"
_REASON_CHARS = 1500  # a marker stays within one 4 KB block, so rewriting it in place needs no new block


def marker_text(run_id: str, status: str, started: str | None = None, *, reason: str | None = None,
                kind: str | None = None, run_name: str | None = None, note: dict | None = None) -> str:
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    if reason is not None and len(reason) > _REASON_CHARS:
        reason = reason[:_REASON_CHARS] + " ..."
    optional = {"reason": reason, "kind": kind, "run_name": run_name}
    return json.dumps({**(note or {}), "run_id": run_id, "status": status, "pid": os.getpid(),
                       "host": socket.gethostname(), "time": now, "started": started or now,
                       **{k: v for k, v in optional.items() if v is not None}}) + "\n"


def create_marker(folder: Path, text: str) -> bool:
    """The atomic claim: create the marker only if there is none (False otherwise). A write that fails (a full
    disk) removes the empty marker it created, which would otherwise hold the folder for good."""
    try:
        fd = os.open(folder / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        write_all(fd, text.encode())
    except OSError as e:
        os.close(fd)
        (folder / MARKER).unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(folder / MARKER, "the run folder's marker", needed=len(text)) from e
        raise
    os.close(fd)
    return True


def write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (one call may write less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def rewrite_marker(folder: Path, text: str) -> None:
    """Swap the marker atomically; where that cannot be done (a full disk has no block for the new file), rewrite
    the existing one in place: it is one block, which it keeps."""
    tmp = folder / f"{MARKER}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, folder / MARKER)
        return
    except OSError:
        tmp.unlink(missing_ok=True)
    with open(folder / MARKER, "r+b") as f:
        f.write(text.encode())
        f.truncate()


def take_over(folder: Path, held_text: str | None, text: str) -> bool:
    """Replace the marker read as `held_text` (a run that ended) by `text`, atomically against racers: it is moved
    aside first, and when what was moved is not what was read (a racer claimed the folder meanwhile) it is put back
    and False returned."""
    aside = folder / f"{MARKER}.{uuid.uuid4().hex[:8]}.old"
    try:
        os.rename(folder / MARKER, aside)
    except FileNotFoundError:
        return create_marker(folder, text)  # gone meanwhile: a fresh claim
    if aside.read_text() != held_text:
        _put_back(aside, folder)
        return False
    try:
        created = create_marker(folder, text)  # False: a racer's fresh claim came in between; it holds the folder
    except BaseException:
        _put_back(aside, folder)
        raise
    aside.unlink(missing_ok=True)
    return created


def _put_back(aside: Path, folder: Path) -> None:
    try:
        os.link(aside, folder / MARKER)  # only where no marker is: never over a racer's
    except OSError:
        pass
    aside.unlink(missing_ok=True)


def read_marker_text(folder: Path) -> str | None:
    """The marker's text as written (what `take_over` compares): None where there is none, "" where unreadable."""
    try:
        return (folder / MARKER).read_text()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return ""


def parse_marker(text: str | None) -> dict:
    """The fields of a marker's text (see `read_marker`)."""
    if text is None:
        return {}
    try:
        held = json.loads(text)
    except ValueError:
        return {"status": "unreadable"}  # being written this instant, or damaged: held by someone
    return held if isinstance(held, dict) else {"status": "unreadable"}


def read_marker(folder: Path) -> dict:
    """The marker of `folder`: {} where there is none, {"status": "unreadable"} where it cannot be read."""
    return parse_marker(read_marker_text(folder))


def holder_running(held: dict) -> bool:
    """Whether the run a marker names may still run (an unreadable marker, or another host's process, counts)."""
    if held.get("status") != "running":
        return held.get("status") == "unreadable"
    if held.get("host") != socket.gethostname():
        return True  # another machine's process: cannot tell, so assume it runs
    pid = held.get("pid")
    if pid == os.getpid():
        return True  # this process holds it: a run that has not ended (e.g. one that crashed the caller's loop)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True
    return True


def describe_holder(held: dict) -> str:
    """Who holds a folder, from its marker: run name and id, status, process and host."""
    name = f"run {held['run_name']!r}, " if isinstance(held.get("run_name"), str) else ""
    ident = f"run id {held['run_id']}, " if held.get("run_id") and held.get("status") != "unreadable" else ""
    return f"{name}{ident}{describe_marker(held)}"


def describe_marker(held: dict) -> str:
    """A marker's status (and how its run ended), when it started, and its process and host."""
    if held.get("status") == "unreadable":
        return "its marker is being written or is damaged"
    ended = f" ({held['reason']})" if isinstance(held.get("reason"), str) else ""
    if held.get("status") == "running" and not holder_running(held):  # SIGKILL, out of memory: nothing could say so
        ended = " when its process ended without recording how (killed, or out of memory)"
    return f"{held.get('status', 'unknown')}{ended}, started {held.get('time', '?')} by process {held.get('pid', '?')} " \
           f"on {held.get('host', '?')}"
