"""Run folders: each run claims its own `<log_dir>/<run_name>/` atomically, before any node starts.

A folder is claimed by creating its marker file `.exogym-run` with O_CREAT | O_EXCL: of two runs (two `fit`
calls, or two processes) asking for one folder, exactly one creates the marker, so two runs never share a
folder, however close in time they start. The marker says who holds the folder (run id, process id, host) and
whether that run is still running.

- A default name (strategy, nodes, time to the second) that is taken gets the suffix -2, -3, ...: the first free
  one is claimed, so a loop of fits in one second, or concurrent processes, each get their own folder.
- An explicit name whose folder already holds a run (a marker, or files such as train.csv) is a RunFolderError
  naming the folder, unless `overwrite=True` (its contents are deleted: the old run is replaced) or the run
  resumes from one of its own checkpoints (it continues in the folder, rows after the checkpoint's step are
  dropped). Neither is allowed while the holder is still running.
- `move_aside` renames the folders of a run that has ended to `<name>.<when it started>` beside them, so a new run
  can take the name and the earlier one is kept (what a rerun of an original EXO Gym script needs).
- Nothing is created before a run is claimed, and a claim given back (a run that never started) removes the
  folders it created, so a run that fails before its first step leaves no folder behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

__all__ = ["RunFolderError", "RunClaim", "claim_run", "check_run_name", "check_writable", "move_aside", "MARKER"]

MARKER = ".exogym-run"
_MAX_SUFFIX = 10_000


class RunFolderError(ValueError):
    """A run folder is taken by another run, or a folder cannot be written."""


def check_run_name(name: object) -> str:
    """A run name is one folder name: not empty, no path separators, not '.' or '..'."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or (os.sep in name) \
            or (os.altsep and os.altsep in name) or "\0" in name:
        raise ValueError(f"run_name must be a folder name (no '/', not empty, not '.' or '..'), got {name!r}; "
                         "put the parent folder in the logger's log_dir instead")
    return name


def check_writable(folder: str | os.PathLike, what: str) -> Path:
    """Check that `folder` can be written (a file created in it, or, where it does not exist yet, in the nearest
    folder above it that does) without creating it; raise RunFolderError saying what to change otherwise. `what`
    names the folder in the message (e.g. "checkpoint_dir")."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{str(existing)!r} is a file, not a folder")
        probe = existing / f".exogym-write-test-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
        probe.unlink()
    except OSError as e:
        raise RunFolderError(f"{what} {str(folder)!r} is not writable ({type(e).__name__}: {e.strerror or e}); "
                             f"pass a folder this process can create and write files in") from e
    return folder


def _make_folder(folder: Path) -> list[Path]:
    """mkdir -p `folder`; return the folders this call created, deepest first (what giving it back removes)."""
    missing = []
    at = folder
    while not at.exists() and at != at.parent:
        missing.append(at)
        at = at.parent
    folder.mkdir(parents=True, exist_ok=True)
    return missing


@dataclass
class RunClaim:
    """The folders one run holds (one per log root), all named `name`."""

    name: str
    run_id: str
    folders: list[Path] = field(default_factory=list)
    resumed: bool = False  # continues a run already in these folders
    created: list[Path] = field(default_factory=list)  # folders above the run folders that the claim made
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    def release(self, status: str) -> None:
        """Mark the folders' run as ended ("completed" or "failed"): it no longer blocks overwrite or resume."""
        for folder in self.folders:
            if not folder.is_dir():
                continue  # the folder went away (given back): nothing to release
            try:
                _write_marker(folder, self.run_id, status, replace=True, started=self.started)
            except OSError:
                pass

    def abandon(self, *, parents: bool = True) -> None:
        """Undo the claim of a run that never started: remove the markers, the folders left empty, and (parents)
        the folders above them that the claim created, if empty."""
        if self.resumed:  # the folder holds the earlier part of the run: keep it, marked as not running
            self.release("failed")
            return
        for folder in self.folders:
            if _read_marker(folder).get("run_id") == self.run_id:
                (folder / MARKER).unlink(missing_ok=True)
            _remove_if_empty(folder)
        if parents:
            for folder in self.created:
                _remove_if_empty(folder)


def _remove_if_empty(folder: Path) -> None:
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
                taken = _claim_one(root / name, claim, overwrite=overwrite, resume=resume)
            except BaseException:
                claim.abandon()
                raise
            if taken is not None:
                claim.abandon()
                raise RunFolderError(taken)
        return claim
    created: list[Path] = []
    for n in range(1, _MAX_SUFFIX):
        candidate = default_name if n == 1 else f"{default_name}-{n}"
        claim = RunClaim(candidate, run_id, created=created)
        try:
            taken = None
            for root in roots:
                taken = _claim_one(root / candidate, claim)
                if taken is not None:
                    break
        except BaseException:
            claim.abandon()
            raise
        if taken is None:
            return claim
        claim.abandon(parents=False)  # taken under one root: give back the others, try the next suffix
    raise RunFolderError(f"no free run folder named {default_name!r} or {default_name}-2 .. -{_MAX_SUFFIX - 1} under "
                         f"{[str(r) for r in roots]}; pass run_name=")


def _claim_one(folder: Path, claim: RunClaim, *, overwrite: bool = False, resume: bool = False) -> str | None:
    """Claim `folder` for `claim` (appended to claim.folders); None when claimed, else why it is taken."""
    try:
        made = _make_folder(folder)
    except OSError as e:
        raise RunFolderError(f"cannot create the run folder {str(folder)!r} ({type(e).__name__}: "
                             f"{e.strerror or e}); pass a log_dir this process can write in") from e
    claim.created.extend(m for m in made[1:] if m not in claim.created)  # made[0] is the run folder itself
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
        return (f"the run folder {str(folder)!r} already holds files ({', '.join(others[:5])}"
                f"{', ...' if len(others) > 5 else ''}); choose another run_name, or pass overwrite=True to "
                "replace its contents")
    try:
        _write_marker(folder, claim.run_id, "running", replace=False, started=claim.started)
    except FileExistsError:
        held = _read_marker(folder)
        return (f"the run folder {str(folder)!r} already holds a run ({_describe(held)}); choose another "
                "run_name, pass overwrite=True to replace it, or resume_from= one of its checkpoints to continue it")
    claim.folders.append(folder)
    return None


def move_aside(folders: Sequence[str | os.PathLike]) -> list[tuple[Path, Path]]:
    """Keep the run that `folders` hold (its folders under several roots, all of one name: the log folder, the
    checkpoint folder) by renaming each that exists to `<name>.<when that run started>` beside it (-2, -3, ...
    when that name is taken), so that a new run can take the name; return the (old, new) pairs.

    Nothing is moved, and [] returned, when no folder holds anything, or when the run has not ended (a marker
    says it is running): claiming the name then fails as usual, naming the running run. The time is the
    marker's start time, else the oldest modification time of what the folders hold."""
    folders = [Path(f) for f in folders]
    present = [f for f in folders if f.is_dir() and any(f.iterdir())]
    if not present:
        return []
    markers = [m for m in (_read_marker(f) for f in present) if m]
    if any(_running(m) for m in markers):
        return []
    stamp = _started(markers, present)
    for n in range(1, _MAX_SUFFIX):
        suffix = stamp if n == 1 else f"{stamp}-{n}"
        targets = [f.with_name(f"{f.name}.{suffix}") for f in present]
        if not any(t.exists() for t in targets):
            break
    moved = []
    for f, target in zip(present, targets):
        try:
            f.rename(target)
        except FileNotFoundError:
            continue  # another process moved it a moment ago
        moved.append((f, target))
    return moved


def _started(markers: list[dict], folders: list[Path]) -> str:
    """When the run in `folders` started, as YYYYmmdd-HHMMSS (a folder-name-safe form)."""
    for held in markers:
        when = held.get("started") or held.get("time")
        try:
            return time.strftime("%Y%m%d-%H%M%S", time.strptime(str(when), "%Y-%m-%d %H:%M:%S"))
        except ValueError:
            continue
    times = [p.stat().st_mtime for f in folders for p in [f, *f.iterdir()]]
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(min(times)))


def _write_marker(folder: Path, run_id: str, status: str, *, replace: bool, started: str | None = None) -> None:
    """replace=False: create the marker only if there is none (the atomic claim); True: swap it in atomically."""
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    text = json.dumps({"run_id": run_id, "status": status, "pid": os.getpid(), "host": socket.gethostname(),
                       "time": now, "started": started or now}) + "\n"
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
