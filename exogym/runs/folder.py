"""Run folders: each run claims its own `<log_dir>/<run_name>/` atomically, before any node starts.

A folder is claimed by creating its marker file `.exogym-run` with O_CREAT | O_EXCL: of two runs (two `fit`
calls, or two processes) asking for one folder, exactly one creates the marker, so two runs never share a
folder, however close in time they start. The marker says who holds the folder (run id, process id, host) and
whether that run is still running.

- A default name (strategy, nodes, time to the second) that is taken gets the suffix -2, -3, ...: the first free
  one is claimed, so a loop of fits in one second, or concurrent processes, each get their own folder.
- An explicit name whose folder already holds a run (a marker, or files such as train.csv) is an error naming
  the folder, unless `overwrite=True` (its contents are deleted: the old run is replaced) or the run resumes
  from one of its own checkpoints (it continues in the folder, rows after the checkpoint's step are dropped).
  Neither is allowed while the holder is still running.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

__all__ = ["RunFolderError", "RunClaim", "claim_run", "check_run_name", "check_writable", "MARKER"]

MARKER = ".exogym-run"
_MAX_SUFFIX = 10_000


class RunFolderError(ValueError):
    """A run folder is taken by another run, or a folder cannot be written."""


class _Taken(RunFolderError):
    """The folder holds another run (a default name then tries the next suffix)."""


def check_run_name(name: object) -> str:
    """A run name is one folder name: not empty, no path separators, not '.' or '..'."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or (os.sep in name) \
            or (os.altsep and os.altsep in name) or "\0" in name:
        raise ValueError(f"run_name must be a folder name (no '/', not empty, not '.' or '..'), got {name!r}; "
                         "put the parent folder in the logger's log_dir instead")
    return name


def check_writable(folder: str | os.PathLike, what: str) -> Path:
    """Create `folder` if needed and check a file can be written in it; raise RunFolderError saying what to
    change otherwise. `what` names the folder in the message (e.g. "checkpoint_dir")."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".exogym-write-test-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise RunFolderError(f"{what} {str(folder)!r} is not writable ({type(e).__name__}: {e.strerror or e}); "
                             f"pass a folder this process can create and write files in") from e
    return folder


@dataclass
class RunClaim:
    """The folders one run holds (one per log root), all named `name`."""

    name: str
    run_id: str
    folders: list[Path] = field(default_factory=list)
    resumed: bool = False  # continues a run already in these folders

    def release(self, status: str) -> None:
        """Mark the folders' run as ended ("completed" or "failed"): it no longer blocks overwrite or resume."""
        for folder in self.folders:
            try:
                _write_marker(folder, self.run_id, status, replace=True)
            except OSError:
                pass  # the folder went away: nothing to release

    def abandon(self) -> None:
        """Undo the claim of a run that never started: remove the markers, and folders left empty."""
        if self.resumed:  # the folder holds the earlier part of the run: keep it, marked as not running
            self.release("failed")
            return
        for folder in self.folders:
            if _read_marker(folder).get("run_id") == self.run_id:
                (folder / MARKER).unlink(missing_ok=True)
            try:
                folder.rmdir()  # only if empty
            except OSError:
                pass


def claim_run(roots: Iterable[str | os.PathLike], name: str | None, default_name: str, *,
              overwrite: bool = False, resume: bool = False) -> RunClaim:
    """Claim `<root>/<name>` under every root for one run.

    name None: `default_name`, or the first of default_name-2, -3, ... free under every root.
    Otherwise `name` exactly: taken is an error, unless overwrite (replace that run) or resume (continue it).
    """
    roots = list(dict.fromkeys(Path(r) for r in roots))
    for root in roots:
        check_writable(root, "the log folder")
    run_id = uuid.uuid4().hex
    if name is not None:
        check_run_name(name)
        claim = RunClaim(name, run_id, resumed=resume)
        for root in roots:
            try:
                _claim_one(root / name, run_id, overwrite=overwrite, resume=resume)
            except BaseException:
                claim.abandon()
                raise
            claim.folders.append(root / name)
        return claim
    for n in range(1, _MAX_SUFFIX):
        candidate = default_name if n == 1 else f"{default_name}-{n}"
        claim = RunClaim(candidate, run_id)
        try:
            for root in roots:
                _claim_one(root / candidate, run_id)
                claim.folders.append(root / candidate)
            return claim
        except _Taken:
            claim.abandon()  # taken under one root: give back the others, try the next suffix
    raise RunFolderError(f"no free run folder named {default_name!r} or {default_name}-2 .. -{_MAX_SUFFIX - 1} under "
                         f"{[str(r) for r in roots]}; pass run_name=")


def _claim_one(folder: Path, run_id: str, *, overwrite: bool = False, resume: bool = False) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunFolderError(f"cannot create the run folder {str(folder)!r} ({type(e).__name__}: "
                             f"{e.strerror or e}); pass a log_dir this process can write in") from e
    held = _read_marker(folder)
    if overwrite or resume:
        if held:
            _refuse_if_running(folder, held, "overwrite=True" if overwrite else "resume")
        if overwrite:
            for entry in folder.iterdir():  # the old run is replaced, as asked; the marker goes last
                if entry.name != MARKER:
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        (folder / MARKER).unlink(missing_ok=True)  # then claimed like a fresh folder: one of two racers wins
    others = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    if not held and others and not (overwrite or resume):
        raise _Taken(f"the run folder {str(folder)!r} already holds files ({', '.join(others[:5])}"
                     f"{', ...' if len(others) > 5 else ''}); choose another run_name, or pass "
                     "overwrite=True to replace its contents")
    try:
        _write_marker(folder, run_id, "running", replace=False)
    except FileExistsError:
        held = _read_marker(folder)
        raise _Taken(f"the run folder {str(folder)!r} already holds a run ({_describe(held)}); choose "
                     "another run_name, pass overwrite=True to replace it, or resume_from= one of its "
                     "checkpoints to continue it") from None


def _write_marker(folder: Path, run_id: str, status: str, *, replace: bool) -> None:
    """replace=False: create the marker only if there is none (the atomic claim); True: swap it in atomically."""
    text = json.dumps({"run_id": run_id, "status": status, "pid": os.getpid(), "host": socket.gethostname(),
                       "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"
    if not replace:
        fd = os.open(folder / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return
    tmp = folder / f"{MARKER}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / MARKER)


def _read_marker(folder: Path) -> dict:
    try:
        held = json.loads((folder / MARKER).read_text())
        return held if isinstance(held, dict) else {"status": "unreadable"}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {"status": "unreadable"}  # being written this instant, or damaged: held by someone


def _running(held: dict) -> bool:
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
    except (PermissionError, TypeError, ValueError):
        return True
    return True


def _refuse_if_running(folder: Path, held: dict, what: str) -> None:
    if _running(held):
        raise RunFolderError(f"the run folder {str(folder)!r} is in use by a run that has not ended "
                             f"({_describe(held)}); {what} is refused while it runs. If that run is gone, delete "
                             f"{str(folder / MARKER)!r}")


def _describe(held: dict) -> str:
    if held.get("status") == "unreadable":
        return "its marker is being written or is damaged"
    return f"{held.get('status', 'unknown')}, started {held.get('time', '?')} by process {held.get('pid', '?')} " \
           f"on {held.get('host', '?')}"
