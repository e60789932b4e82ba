"""A sweep's definition: what sweep.json (and the study's user attribute exogym_sweep) holds, read and compared.

Everything needed to resume or join the sweep, or to read its results: the space, the objective, the search,
where the study lives, the run function's name, and how the sweep ran (workers, threads, heartbeat), so that a
resume runs as the sweep did.
"""

from __future__ import annotations

import importlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from exogym.sweep.objective import Objective
from exogym.sweep.space import Space
from exogym.sweep.storage import JOURNAL, disk_error, shown_url
from exogym.sweep.study import SweepStudy

__all__ = ["Definition", "DEFINITION", "read_definition", "write_json", "check_same"]

DEFINITION = "sweep.json"


@dataclass
class Definition:
    """What sweep.json holds: everything needed to resume or join the sweep, or to read its results."""

    folder: str
    space: Space
    objective: Objective
    search: str
    trials: int | None
    storage: str  # a database URL, or "default" (a JournalStorage file: <folder>/study.journal)
    study_name: str
    sampler_seed: int
    checkpoint_interval: int | None
    run: str  # "module:qualname" of the run function (or of a callable object's class)
    run_repr: str = ""  # a callable object's repr (its settings), compared on resume
    command: list[str] | None = None  # a CLI sweep: its fixed part (see exogym.cli.sweep)
    flags: dict[str, str] = field(default_factory=dict)  # a CLI sweep: parameter -> option
    argv: list[str] | None = None  # a CLI sweep: its command line, which --resume parses again
    workers: int = 1  # worker processes, and torch threads each: a resume runs the same unless told otherwise
    threads: int = 1
    heartbeat: int = 10  # a database's heartbeat (s); a trial silent for grace seconds is failed and queued again
    grace: int = 60
    max_retry: int = 2  # times a configuration whose worker died is queued again
    storage_patience: float = 600.0  # seconds a worker waits for an unreachable storage before it gives up

    @property
    def path(self) -> Path:
        return Path(self.folder)

    @property
    def url(self) -> str:
        """The storage as messages name it: the journal file, or the database URL."""
        return str(self.path / JOURNAL) if self.storage == "default" else self.storage

    @property
    def shown_storage(self) -> str:
        return f"the journal file {self.path / JOURNAL}" if self.storage == "default" else shown_url(self.storage)

    def open_study(self, *, create: bool = False, worker: int = 0, worker_id: str = "") -> SweepStudy:
        """The sweep's study; worker i's sampler is seeded sampler_seed + i, so that workers starting together do
        not propose the same configurations."""
        return SweepStudy(self, create=create, worker=worker, worker_id=worker_id)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "space": self.space.to_json(), "objective": self.objective.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Definition":
        return cls(**{**data, "space": Space.from_json(data["space"]),
                      "objective": Objective.from_json(data["objective"])})

    def load_run(self) -> Callable[..., Any]:
        module, _, name = self.run.partition(":")
        try:
            target: Any = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
            if self.run_repr:
                raise ImportError  # a callable object: its settings cannot be rebuilt from here
        except (ImportError, AttributeError):
            raise ValueError(f"this sweep runs {self.run!r}, which cannot be imported from here; rerun the script "
                             "that started it with resume=True") from None
        return target


def write_json(path: Path, data: dict[str, Any], *, exclusive: bool) -> None:
    """JSON written whole (a temporary file renamed, or linked when `exclusive`: FileExistsError if taken)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        if exclusive:
            os.link(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as e:
        if isinstance(e, FileExistsError):
            raise
        raise OSError(f"cannot write {path}: {disk_error(e)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_definition(folder: str | os.PathLike) -> Definition:
    path = Path(folder) / DEFINITION
    if not path.exists():
        raise FileNotFoundError(f"{str(folder)!r} holds no sweep (no {DEFINITION}); start one there instead")
    try:
        definition = Definition.from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): it is damaged or from another version; "
                         "start the sweep again in a new folder") from None
    definition.folder = str(Path(folder).resolve())  # where it is now (a sweep folder may be moved or copied)
    return definition


def _differences(stored: Definition, given: Definition) -> list[str]:
    return [f"{what}: stored {a} , given {b}" for what, a, b in (
        ("space", stored.space.describe(), given.space.describe()),
        ("objective", stored.objective.describe(), given.objective.describe()),
        ("search", stored.search, given.search),
        ("run function", stored.run.split(":")[-1], given.run.split(":")[-1]),  # a script's module is __main__
        ("run function's settings", stored.run_repr, given.run_repr)) if a != b]


def check_same(stored: Definition, given: Definition, where: str) -> None:
    diffs = _differences(stored, given)
    if stored.search != "grid" and given.trials is not None and given.trials < (stored.trials or 0):
        diffs.append(f"trials: stored {stored.trials}, given {given.trials} (a search may be extended, not cut)")
    if diffs:
        raise ValueError(f"the sweep in {where} was started differently; resuming or joining it with other settings "
                         f"would mix two experiments: {'; '.join(diffs)}. Use the same settings, or another out= "
                         "(and study name)")
