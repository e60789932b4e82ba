"""What running a run name again does: the earlier run moves aside, kept, and the new one takes the name.

One rule for every way `fit` is called: when the folders of an explicit run name hold a run that has ended, that run
is kept by renaming its folders to `<name>.<when it started>` (exogym.runs.folder.move_aside) and a warning names
both; the new run then writes where the name points, where a script reads. Its folders are the run folder under
every log root and, when checkpoint_dir holds checkpoints of the run of that name, the checkpoint folder (all
renamed with one time stamp). Not moved: a run still running, or one whose process ended without recording how
(killed, out of memory: its marker still says running; it is one to resume), whose name claiming then refuses,
naming it; a folder holding files of no run (claiming refuses it, naming them); nothing when overwrite=True (the
run is replaced) or resume_from= continues it (fit does not call this then).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Sequence

from exogym._validation import caller_level
from exogym.runs.checkpoint import CheckpointError, read_manifest
from exogym.runs.folder import move_aside
from exogym.runs.marker import read_marker

__all__ = ["keep_earlier_run", "RUN_FILES"]

# What makes a folder without a marker one of a run: the files a CSV run folder holds (also the original EXO Gym's).
RUN_FILES = ("config.json", "train.csv", "val.csv", "validation.csv", "summary.json")


def keep_earlier_run(run_folders: Sequence[str | os.PathLike], name: str,
                     checkpoint_dir: str | os.PathLike | None = None) -> list[tuple[Path, Path]]:
    """Move the ended run of `name` out of the way (see the module's docstring); return the (old, new) pairs."""
    folders = [Path(f) for f in run_folders if _holds_a_run(Path(f))]
    if checkpoint_dir is not None and _holds_checkpoints_of(Path(checkpoint_dir), name) \
            and Path(checkpoint_dir) not in folders:
        folders.append(Path(checkpoint_dir))
    if any(read_marker(f).get("status") == "running" for f in folders):
        return []  # running, or killed without a word: left for resume_from= (claiming names it)
    moved = move_aside(folders)
    if moved:
        old, new = ", ".join(str(a) for a, _ in moved), ", ".join(str(b) for _, b in moved)
        warnings.warn(f"{old} held an earlier run, which is kept, moved to {new}; this run writes to {old}",
                      UserWarning, stacklevel=caller_level())
    return moved


def _holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and (
        bool(read_marker(folder)) or any((folder / f).is_file() for f in RUN_FILES))


def _holds_checkpoints_of(folder: Path, name: str) -> bool:
    """The checkpoint folder holds checkpoints, all of the run named `name`."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    names = set()
    for manifest in folder.glob("step_*/manifest.json"):
        if not manifest.parent.name[len("step_"):].isdigit():
            continue  # an unfinished (.partial) checkpoint
        try:
            names.add(read_manifest(manifest.parent).get("run_name"))
        except CheckpointError:
            return False  # unreadable: not moved; checking the folder's owner names it
    return names == {name}
