"""Where a sweep's Optuna study lives, and what a worker does when that place goes away.

- One machine (the default): Optuna's JournalStorage, a log file `<sweep folder>/study.journal` that several
  processes on this host append to under a file lock (Optuna's answer for parallel workers on one host; SQLite
  cannot hand trials to several processes safely, so an `sqlite:` URL is for one process only).
- Several machines: any database URL SQLAlchemy takes (`postgresql://user@host/db` with `exogym[postgres]`,
  which installs psycopg 3, the driver SQLAlchemy 2 maps `postgresql://` to). Optuna's RDBStorage, with its
  heartbeat: a running trial whose heartbeat stops for `grace` seconds is failed by the next worker that looks
  (`optuna.storages.fail_stale_trials`) and queued again by Optuna's `RetryHeartbeatStaleTrialCallback`.

An outage of the database (a restart, the network) is an operational error: `patient(call)` retries a call with
backoff (1, 2, 4, ... 30 s) until `patience` seconds have gone, saying so in one line each time (which URL, the
error, when it retries), then gives up with one line. Nothing here ever calls an operational error an internal
one.
"""

from __future__ import annotations

import errno
import json
import re
import sys
import time
import warnings
import contextlib
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

__all__ = ["JOURNAL", "INSTALL", "POSTGRES", "StorageUnavailable", "SweepStopped", "import_optuna", "open_storage", "patient",
           "is_operational", "shown_url", "check_url", "writing"]

JOURNAL = "study.journal"
INSTALL = "pip install 'exogym[sweep]'"
POSTGRES = "pip install 'exogym[postgres]'"
T = TypeVar("T")


class StorageUnavailable(RuntimeError):
    """The study's storage stayed unreachable for longer than the sweep's patience (or cannot be opened at all)."""


class SweepStopped(RuntimeError):
    """A sweep stopped for a reason its message gives in one line (a worker's error, a script without its main
    guard)."""


def import_optuna(why: str) -> Any:
    """Optuna, with its log quiet (the sweep prints its own lines); ImportError naming the extra otherwise."""
    try:
        import optuna
    except ImportError as e:
        raise ImportError(f"{why} needs Optuna: {INSTALL}") from e
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # not "Trial 3 failed": the sweep reports its trials
    return optuna


def shown_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def check_url(url: str) -> None:
    """A storage URL Optuna can open: its scheme known and its driver installed (ValueError/ImportError naming the
    fix otherwise). Nothing is created."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if not scheme:
        raise ValueError(f"storage must be a database URL (postgresql://user@host/db, mysql://..., sqlite:///file), "
                         f"got {url!r}; leave it out for the default (a journal file in the sweep folder)")
    try:
        from sqlalchemy.engine import make_url
        make_url(url).get_dialect().import_dbapi()  # the driver itself, not only SQLAlchemy's name for it
    except ImportError as e:
        fix = POSTGRES if scheme.startswith("postgres") else f"the driver of {scheme!r}"
        raise ImportError(f"storage {shown_url(url)}: its database driver is not installed ({e}); install it: {fix}") \
            from None
    except Exception as e:  # sqlalchemy.exc.NoSuchModuleError, ArgumentError: an unknown scheme or a malformed URL
        raise ValueError(f"storage {shown_url(url)!r} is not a database URL SQLAlchemy knows ({type(e).__name__}: "
                         f"{e}); use postgresql://user@host/db (with {POSTGRES}), mysql://..., or sqlite:///file") \
            from None
    if scheme.startswith("sqlite"):
        _check_sqlite_file(url)


def _check_sqlite_file(url: str) -> None:
    """An SQLite file that cannot be created or opened is refused now (SQLite says only "unable to open database
    file", which patient() would retry for storage_patience seconds as if a server were down). Nothing is left:
    a file made to try is removed."""
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    path = Path(database)
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise ValueError(f"storage {shown_url(url)}: the SQLite file {path} cannot be {'opened' if existed else 'created'}"
                         f" ({e.strerror or e}); give a file in a folder you can write to") from None
    if not existed:
        path.unlink(missing_ok=True)


def is_operational(e: BaseException) -> bool:
    """Whether `e` says the storage is unreachable (worth retrying), not that a request was wrong."""
    try:
        from sqlalchemy import exc
    except ImportError:  # pragma: no cover - Optuna requires SQLAlchemy
        exc = None
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, StorageUnavailable):
            return False  # the patience is spent: nothing retries it
        if exc is not None and isinstance(e, (exc.OperationalError, exc.InterfaceError)):
            return True
        if exc is not None and isinstance(e, exc.DBAPIError) and e.connection_invalidated:
            return True
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def patient(call: Callable[[], T], *, url: str, patience: float, what: str = "the study",
            log: Callable[[str], None] | None = None) -> T:
    """call(), retried with backoff while the storage is unreachable, for up to `patience` seconds."""
    deadline = time.monotonic() + patience
    delay = 1.0
    while True:
        try:
            return call()
        except Exception as e:
            damage = _damage(e, url)
            if damage is not None:
                raise StorageUnavailable(damage) from None
            if not is_operational(e):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(f"the study's storage {shown_url(url)} stayed unreachable for {patience:g} s "
                                         f"({_reason(e)}); finished runs are kept in their run folders: start the "
                                         f"database again, then resume the sweep") from None
            wait = min(delay, left)
            at = (datetime.now() + timedelta(seconds=wait)).strftime("%H:%M:%S")
            (log or _stderr)(f"exogym sweep: storage {shown_url(url)} unreachable while writing {what} "
                             f"({_reason(e)}); retrying at {at}, giving up after {patience:g} s (storage_patience)")
            time.sleep(wait)
            delay = min(delay * 2, 30.0)


def _chain(e: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while e is not None and all(e is not s for s in seen):
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _damage(e: BaseException, url: str) -> str | None:
    """One line for a journal file that cannot be read (damaged) or written (a full disk), else None."""
    if "://" in url:
        return None
    for inner in _chain(e):
        if isinstance(inner, OSError) and inner.errno is not None:
            return f"cannot write the study file {url}: {disk_error(inner)}"
        if isinstance(inner, (json.JSONDecodeError, UnicodeDecodeError)):
            return (f"the study file {url} cannot be read ({inner}): it is damaged; move it away and start the sweep "
                    "again in a new folder (the run folders beside it are kept)")
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _reason(e: BaseException) -> str:
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    orig = getattr(inner, "orig", None) or inner
    text = " ".join(str(orig).split())
    return f"{type(orig).__name__}: {text[:200]}"


def open_storage(url: str, *, folder: Path, heartbeat: int, grace: int, max_retry: int | None,
                 patience: float = 600.0) -> Any:
    """The Optuna storage of a sweep: the journal file in `folder` for url "default", else an RDBStorage with
    Optuna's heartbeat (a stale trial is failed and queued again at most max_retry times)."""
    optuna = import_optuna("a sweep")
    if url == "default":
        from optuna.storages.journal import JournalFileBackend

        path = folder / JOURNAL
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
        except OSError as e:
            raise StorageUnavailable(f"cannot open the study file {path}: {disk_error(e)}") from None
        except Exception as e:
            raise StorageUnavailable(f"the study file {path} cannot be read ({type(e).__name__}: {e}): it is "
                                     f"damaged; move it away and start the sweep again in a new folder (the run "
                                     f"folders beside it are kept)") from None
    check_url(url)
    kwargs: dict[str, Any] = {"pool_pre_ping": True}  # a connection the server dropped (a restart) is replaced
    if url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": 60}}

    def connect() -> Any:
        from sqlalchemy import exc

        for attempt in range(5):
            try:
                with warnings.catch_warnings():  # Optuna calls its heartbeat experimental
                    warnings.simplefilter("ignore")
                    return _PatientRDBStorage(
                        url, engine_kwargs=kwargs, heartbeat_interval=heartbeat, grace_period=grace,
                        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                            max_retry=max_retry))  # queues a stale trial again
            except (exc.IntegrityError, exc.ProgrammingError):
                # Two machines starting on an empty database both create Optuna's tables; the second to commit
                # is refused ("already exists"). Its next try finds them made.
                if attempt == 4:
                    raise
                time.sleep(0.5 + attempt)
    return patient(connect, url=url, patience=patience, what="the study (connecting)")


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """An OSError while writing `what` at `path` (a full disk: matplotlib's and Python's own writes say only
    "[Errno 28] No space left on device") becomes one naming the path and the fix."""
    try:
        yield
    except OSError as e:
        if isinstance(e, FileExistsError) or e.errno is None:
            raise
        raise OSError(e.errno, f"cannot write {what} {path}: {disk_error(e)}") from None


def disk_error(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "the disk is full; free space, then resume the sweep"
    return f"{e.strerror or e} ({type(e).__name__})"


def _rdb_class() -> Any:
    import optuna

    class PatientRDBStorage(optuna.storages.RDBStorage):
        """Optuna's RDBStorage whose heartbeat outlives an outage: a beat that cannot reach the database is
        skipped (Optuna's heartbeat thread would end on the first one, and the trial would look dead once the
        database is back)."""

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                super().record_heartbeat(trial_id)
            except Exception as e:
                if not is_operational(e):
                    raise

    return PatientRDBStorage


def _PatientRDBStorage(*args: Any, **kwargs: Any) -> Any:
    global _RDB
    if _RDB is None:
        _RDB = _rdb_class()
    return _RDB(*args, **kwargs)


_RDB: Any = None
