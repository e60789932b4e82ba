"""Full disks: a write that runs out of space is a DiskFullError naming the path, what it needed and what is free.

The OS says "no space" with errno ENOSPC (EDQUOT for a quota). torch.save does not: on a full disk it raises
`RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos ...`, so a failed write is also taken as a
full disk when, once its partial file is removed, the disk still has less free space than the write needed.

What is written here ends whole or not at all, so a full disk leaves nothing half-written behind: a text file is
written beside its name and renamed into place (`write_text`); a row appended to a table is one write, cut back to
the table's size before it when the write fails (`AppendFile`).

This module imports nothing of exogym or torch (the run folder's marker, exogym.runs.marker, writes with it).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Iterator

__all__ = ["DiskFullError", "disk_full", "is_disk_full", "drop_frames", "free_bytes", "format_bytes", "write_text",
           "AppendFile", "warn"]

_FULL = {errno.ENOSPC, errno.EDQUOT}
# A failed write whose size was estimated (torch.save's file is its tensors' bytes plus a zip/pickle overhead of a
# few hundred bytes per tensor) is a full disk when less than this is free on top of the estimate.
_SLACK_BYTES = 64 * 1024


class DiskFullError(OSError):
    """A write ran out of disk space (errno ENOSPC); the message says what to change.

    Args:
        message: What happened and what to change.
        path: What was being written (the exception's `filename`).
        needed: The bytes needed (None where unknown).
        free: The bytes free (None where unknown).
    """

    def __init__(self, message: str, path: str | os.PathLike, needed: int | None = None, free: int | None = None):
        super().__init__(errno.ENOSPC, message)
        self.filename = str(path)
        self.needed, self.free = needed, free

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple:  # crosses from a node's process to the caller intact
        return type(self), (self.strerror, self.filename, self.needed, self.free)


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes this process may still write on the disk holding `path` (or the nearest folder above it that exists);
    None when that cannot be told."""
    at = Path(path)
    while not at.exists() and at != at.parent:
        at = at.parent
    try:
        if hasattr(os, "statvfs"):
            fs = os.statvfs(at)  # root may also write the blocks a filesystem reserves for it
            return (fs.f_bfree if os.geteuid() == 0 else fs.f_bavail) * fs.f_frsize
        return shutil.disk_usage(at).free
    except OSError:
        return None


def format_bytes(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit, size in (("PB", 1 << 50), ("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def disk_full(path: str | os.PathLike, what: str, *, needed: int | None = None, at_least: bool = False,
              free: int | None = None, hint: str = "") -> DiskFullError:
    """The DiskFullError for writing `what` at `path` (`free`: measured now when not given)."""
    free = free_bytes(path) if free is None else free
    if needed is not None and free is not None and needed <= free:  # a lower bound, and the write did not fit
        size = f"more than the {format_bytes(free)} free on its disk (at least {format_bytes(needed)})"
    elif needed is not None:
        size = f"{'at least ' if at_least else ''}{format_bytes(needed)} but its disk has {format_bytes(free)} free"
    else:
        size = f"more than the {format_bytes(free)} free on its disk"
    return DiskFullError(f"disk full: {what} {str(path)!r} needs {size}; free space on that disk or write to a folder "
                         f"on another disk{hint}", path, needed, free)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(error: BaseException, path: str | os.PathLike, needed: int | None = None,
                 free: int | None = None) -> bool:
    """Whether `error`, raised writing about `needed` bytes at `path`, means the disk is full: an OSError with
    ENOSPC/EDQUOT in its chain, or (torch.save's RuntimeError says nothing) less free space than the write needed:
    `free`, measured before the write (else now, which counts a partial file still on the disk)."""
    if isinstance(error, DiskFullError):
        return True
    if any(isinstance(e, OSError) and e.errno in _FULL for e in _chain(error)):
        return True
    if needed is None:
        return False
    free = free_bytes(path) if free is None else free
    return free is not None and free < needed + max(_SLACK_BYTES, needed // 100)


def drop_frames(error: BaseException) -> None:
    """Let go of the frames of a failed write (the tracebacks in `error`'s chain): a writer left open in them
    (torch.save's) keeps its file, and the disk space it took, until they go, even once the file is unlinked."""
    for e in _chain(error):
        e.__traceback__ = None


def write_text(path: str | os.PathLike, text: str, what: str) -> None:
    """Write `path` whole or not at all: into a file beside it, renamed into place. A full disk leaves no file
    behind and raises DiskFullError naming `what` (e.g. "the run's config")."""
    path = Path(path)
    data = text.encode()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if is_disk_full(e, path):
            raise disk_full(path, what, needed=len(data)) from e
        raise


class AppendFile:
    """A file grown by whole pieces (a table's rows): each `append` lands in full or not at all. A write that fails
    is cut back to the file's size before it, so the file never ends mid-row; a full disk raises DiskFullError.
    A symbolic link at `path` is refused (ELOOP) rather than followed."""

    def __init__(self, path: str | os.PathLike, what: str, *, fresh: bool):
        self.path, self.what = Path(path), what
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0) | (os.O_TRUNC if fresh else 0)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def append(self, text: str) -> None:
        data = memoryview(text.encode())
        start = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)  # back to the last whole row
            except OSError:
                pass
            if is_disk_full(e, self.path):
                raise disk_full(self.path, self.what, needed=len(text.encode())) from e
            e.filename = e.filename or str(self.path)
            raise

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def warn(message: str) -> None:
    """One line on stderr, for a failure that must not hide the run's own error (a summary that cannot be written)."""
    print(f"exogym: {message}", file=sys.stderr, flush=True)
