"""Run folders: each run claims its own `<log_dir>/<run_name>/` atomically, before any node starts.

A folder is claimed by creating its marker file `.exogym-run` (exogym.runs.marker: what it says, how it is written
and read) with O_CREAT | O_EXCL: of two runs (two `fit` calls, or two processes) asking for one folder, exactly one
creates the marker, so two runs never share a folder, however close in time they start.

- A default name (strategy, nodes, time to the second) that is taken gets the suffix -2, -3, ...: the first free
  one is claimed, so a loop of fits in one second, or concurrent processes, each get their own folder.
- An explicit name whose folder already holds a run (a marker, or files such as train.csv) is a RunFolderError
  naming the folder, unless `overwrite=True` (its contents are deleted: the old run is replaced) or the run
  resumes from one of its own checkpoints (it continues in the folder, rows after the checkpoint's step are
  dropped). Neither is allowed while the holder is still running.
- A run name is one folder name (`check_run_name` states the rule); a run folder that is a symbolic link is refused,
  and deleting a folder's contents unlinks the links in it: nothing outside the log folder is written or deleted.
- A checkpoint folder is held by the run writing into it while it runs (`hold_folder`: the same marker, with
  "kind": "checkpoints", removed at release; from then on its checkpoints' manifests say whose they are).
- `move_aside` renames the folders of a run that has ended to `<name>.<when it started>` beside them, so a new run
  can take the name and the earlier one is kept (what a rerun of an original EXO Gym script needs).
- Nothing is created before a run is claimed, and a claim given back (a run that never started) removes the
  folders it created, so a run that fails before its first step leaves no folder behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from exogym.runs.disk import disk_full
# MARKER is also this module's: the marker is what makes a folder a run folder (the tests import it here)
from exogym.runs.marker import (MARKER, create_marker, describe_marker, holder_running, marker_text, parse_marker,
                                read_marker, read_marker_text, rewrite_marker, take_over, write_all)

__all__ = ["RunFolderError", "RunClaim", "claim_run", "check_run_name", "check_writable", "move_aside", "hold_folder",
           "remove_tree", "MARKER", "RUN_NAME_MAX_CHARS", "RUN_NAME_MAX_BYTES"]

_MAX_SUFFIX = 10_000
# A folder name holds 255 bytes on common filesystems; a moved-aside copy appends up to 21 (".20260101-120000-9999").
RUN_NAME_MAX_CHARS, RUN_NAME_MAX_BYTES = 100, 200
_BAD_CATEGORIES = {"Cc": "a control character", "Zl": "a line separator", "Zp": "a paragraph separator",
                   "Cs": "an unpaired surrogate"}
_PROBE_BYTES = 64 * 1024  # what check_writable writes: room for a run's config.json, some hundred rows and summary


class RunFolderError(ValueError):
    """A run folder is taken by another run, or a folder cannot be written."""


def check_run_name(name: object) -> str:
    """The one rule for a run name, which is one folder inside the log folder: a string of 1 to 100 characters
    (200 bytes as UTF-8), not only spaces, not '.' or '..', with no path separator ('/', and the OS's own) and no
    control character (Unicode categories Cc, Zl, Zp, Cs: newline, tab, NUL, ...)."""
    rule = (f"a run name is one folder name: 1 to {RUN_NAME_MAX_CHARS} characters ({RUN_NAME_MAX_BYTES} bytes as "
            "UTF-8), not only spaces, not '.' or '..', with no '/' and no control characters (newline, tab, NUL)")
    why = None
    if not isinstance(name, str):
        why = f"got a {type(name).__name__}"
    elif not name.strip():
        why = "it is empty" if not name else "it is only spaces"
    elif name in (".", ".."):
        why = f"{name!r} is not a folder of its own"
    elif any(sep and sep in name for sep in ("/", os.sep, os.altsep)):
        why = "it holds a path separator"
    else:
        bad = next((c for c in name if unicodedata.category(c) in _BAD_CATEGORIES), None)
        if bad is not None:
            why = f"it holds {_BAD_CATEGORIES[unicodedata.category(bad)]} ({bad!r})"
        elif len(name) > RUN_NAME_MAX_CHARS:
            why = f"it has {len(name)} characters"
        elif len(name.encode("utf-8")) > RUN_NAME_MAX_BYTES:
            why = f"it has {len(name.encode('utf-8'))} bytes as UTF-8"
    if why is not None:
        raise ValueError(f"run_name must be a folder name: {why}, got {name!r}; {rule}. Put parent folders in the "
                         "logger's log_dir instead")
    return name


def check_writable(folder: str | os.PathLike, what: str) -> Path:
    """Check that `folder` can be written (a 64 KB file written in it, or, where it does not exist yet, in the
    nearest folder above it that does) without creating it; raise RunFolderError saying what to change otherwise,
    or DiskFullError when its disk is full. `what` names the folder (e.g. "checkpoint_dir")."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{str(existing)!r} is a file, not a folder")
        probe = existing / f".exogym-write-test-{uuid.uuid4().hex}"
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        # Local filesystems report a full disk at write(), NFS at close(), which raises it too; no fsync, which
        # would cost a journal commit per check. Random bytes: a compressing filesystem stores zeros in no space.
        try:
            write_all(fd, os.urandom(_PROBE_BYTES))
        finally:
            try:
                os.close(fd)
            finally:
                probe.unlink()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(folder, what, needed=_PROBE_BYTES, at_least=True) from e
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


def _refuse_link(folder: Path, what: str, fix: str) -> None:
    if folder.is_symlink():
        raise RunFolderError(f"{what} {str(folder)!r} is a symbolic link to {os.readlink(folder)!r}; exogym writes and "
                             f"deletes only inside its own folders and does not follow it: remove the link, or {fix}")


def remove_tree(path: Path) -> None:
    """Delete `path`: a folder with what it holds, a file, or a symbolic link (the link itself, never its target;
    shutil.rmtree does not follow the links inside a folder either)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


@dataclass
class RunClaim:
    """The folders one run holds: its run folders (one per log root, all named `name`) and the checkpoint folders
    it writes (`hold_folder`)."""

    name: str
    run_id: str
    folders: list[Path] = field(default_factory=list)
    resumed: bool = False  # continues a run already in these folders
    created: list[Path] = field(default_factory=list)  # folders above the run folders that the claim made
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))
    held: dict[Path, str] = field(default_factory=dict)  # checkpoint folder -> the marker this run wrote there
    held_made: dict[Path, list[Path]] = field(default_factory=dict)  # checkpoint folder -> the folders made for it
    earlier: dict[Path, str] = field(default_factory=dict)  # run folder -> the ended marker it replaced (resume)

    def release(self, status: str, reason: str | None = None) -> None:
        """Mark the folders' run as ended ("completed", "failed", "interrupted"; `reason`: why, e.g. the error):
        it no longer blocks overwrite or resume. Needs no free space: on a full disk the marker is rewritten in
        place. The checkpoint folders are let go (their manifests say whose checkpoints they hold)."""
        self._let_go()
        for folder in self.folders:
            if not folder.is_dir():
                continue  # the folder went away (given back): nothing to release
            try:
                rewrite_marker(folder, marker_text(self.run_id, status, self.started, reason=reason))
            except OSError as e:
                print(f"exogym: could not record that the run in {str(folder)!r} {status} ({e})", file=sys.stderr,
                      flush=True)

    def abandon(self, *, parents: bool = True) -> None:
        """Undo the claim of a run that never started: remove the markers, the folders left empty, and (parents)
        the folders above them that the claim created, if empty. A folder the run resumed in gets its earlier
        marker back."""
        self._let_go()
        for folder in self.folders:
            if folder in self.earlier:  # the folder of the run it resumed: as it was
                rewrite_marker(folder, self.earlier[folder])
            elif self.resumed:  # it holds the earlier part of the run (no marker before): kept, not running
                rewrite_marker(folder, marker_text(self.run_id, "failed", self.started,
                                                   reason="the resumed run stopped before its first step"))
            else:
                if read_marker(folder).get("run_id") == self.run_id:
                    (folder / MARKER).unlink(missing_ok=True)
                _remove_if_empty(folder)
        if parents and not self.resumed:
            for folder in self.created:
                _remove_if_empty(folder)

    def let_go(self, folder: Path) -> None:
        """Stop holding checkpoint folder `folder`: this run's marker goes, and the folders made for it if empty."""
        if read_marker_text(folder) == self.held.pop(folder, None):
            (folder / MARKER).unlink(missing_ok=True)
        for made in self.held_made.pop(folder, []):
            _remove_if_empty(made)

    def _let_go(self) -> None:
        for folder in list(self.held):
            self.let_go(folder)


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
    if name is not None:
        check_run_name(name)
    for root in roots:
        check_writable(root, "the log folder")
    run_id = uuid.uuid4().hex
    if name is not None:
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
    """Claim `folder` for `claim` (appended to claim.folders); None when claimed, else why it is taken. The marker
    is taken first, and only then (overwrite) the old contents deleted: a racer that lost deletes nothing."""
    _refuse_link(folder, "the run folder", "choose another run_name")
    try:
        made = _make_folder(folder)
    except OSError as e:
        raise RunFolderError(f"cannot create the run folder {str(folder)!r} ({type(e).__name__}: "
                             f"{e.strerror or e}); pass a log_dir this process can write in") from e
    claim.created.extend(m for m in made[1:] if m not in claim.created)  # made[0] is the run folder itself
    text = read_marker_text(folder)
    held = parse_marker(text)
    mine = marker_text(claim.run_id, "running", claim.started)
    if held and (overwrite or resume):
        _refuse_if_running(folder, held, "overwrite=True" if overwrite else "resume")
        if not take_over(folder, text, mine):
            return (f"the run folder {str(folder)!r} was claimed a moment ago by another run "
                    f"({describe_marker(read_marker(folder))})")
        if resume:
            claim.earlier[folder] = text
    else:
        others = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
        if not held and others and not (overwrite or resume):
            return (f"the run folder {str(folder)!r} already holds files ({', '.join(others[:5])}"
                    f"{', ...' if len(others) > 5 else ''}); choose another run_name, or pass overwrite=True to "
                    "replace its contents")
        if not create_marker(folder, mine):
            return (f"the run folder {str(folder)!r} already holds a run ({describe_marker(read_marker(folder))}); "
                    "choose another run_name, pass overwrite=True to replace it, or resume_from= one of its "
                    "checkpoints to continue it")
    claim.folders.append(folder)
    if overwrite:
        for entry in folder.iterdir():  # the old run is replaced, as asked; links are unlinked, not followed
            if entry.name != MARKER:
                remove_tree(entry)
    return None


def hold_folder(folder: Path, claim: RunClaim, *, run_id: str, run_name: str | None = None,
                note: dict | None = None) -> dict | None:
    """Hold the checkpoint folder `folder` for the run of `claim` (whose checkpoints carry `run_id`) while it runs:
    its marker is created atomically (mkdir -p first), and removed when the claim is released or given back.
    None when held (or it is one of the claim's own run folders); otherwise the marker of who holds it: a run that
    has not ended, or another run whose run folder it is. The marker of a run that ended without letting the
    folder go (its process was killed) is replaced. `note`: more fields for the marker (see `read_marker`)."""
    if folder in claim.folders or folder in claim.held:
        return None
    made = _make_folder(folder)
    text = read_marker_text(folder)
    held = parse_marker(text)
    mine = marker_text(run_id, "running", claim.started, kind="checkpoints", run_name=run_name, note=note)
    refused = None
    if held and (held.get("kind") != "checkpoints" or holder_running(held)):  # another run's run folder, or a live run
        refused = held
    elif not (take_over(folder, text, mine) if held else create_marker(folder, mine)):
        refused = read_marker(folder)  # a racer holds it now
    if refused is not None:
        for m in made:
            _remove_if_empty(m)
        return refused
    claim.held[folder], claim.held_made[folder] = mine, made
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
    markers = [m for m in (read_marker(f) for f in present) if m]
    if any(holder_running(m) for m in markers):
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


def _refuse_if_running(folder: Path, held: dict, what: str) -> None:
    if holder_running(held):
        raise RunFolderError(f"the run folder {str(folder)!r} is in use by a run that has not ended "
                             f"({describe_marker(held)}); {what} is refused while it runs. If that run is gone, delete "
                             f"{str(folder / MARKER)!r}")
