"""A fit call's loggers, and the run folders they write: which loggers (fit's logger=), the run's one name, and the
claim of its folders under every root a logger writes into."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from exogym.runs.folder import RunClaim, check_run_name, claim_run
from exogym.runs.loggers import CSVLogger, Logger, MultiLogger, WandbLogger, _FolderLogger
from exogym.runs.rerun import keep_earlier_run

__all__ = ["resolve_logger", "run_name_of", "claim_run_folders"]


def resolve_logger(logger: Any, run_name: str | None) -> Logger | None:
    """fit's logger= as one Logger: a CSVLogger by default (None, True), None for False, a MultiLogger for a list."""
    if logger is None or logger is True:
        return CSVLogger(run_name=run_name)
    if logger is False:
        return None
    if isinstance(logger, Logger):
        return logger
    if isinstance(logger, (list, tuple)) and all(isinstance(lg, Logger) for lg in logger):
        return MultiLogger(logger)
    raise TypeError(f"logger must be an exogym.runs.loggers.Logger (CSVLogger, WandbLogger, TensorBoardLogger), a list "
                    f"of them, or False for none; got {logger!r}")


def _loggers(logger: Logger | None) -> list[Logger]:
    if isinstance(logger, MultiLogger):
        return [inner for lg in logger.loggers for inner in _loggers(lg)]
    return [] if logger is None else [logger]


def run_name_of(logger: Logger | None, run_name: str | None) -> str | None:
    """The run's explicit name: fit's run_name, or the one its CSV/TensorBoard loggers were given (None: a default
    name is claimed). Names that disagree are an error: one run has one folder name."""
    if run_name is not None:
        check_run_name(run_name)
    names = {lg.requested_name for lg in _loggers(logger)
             if isinstance(lg, _FolderLogger) and lg.requested_name is not None}
    if run_name is not None and names - {run_name} or run_name is None and len(names) > 1:
        given = ([f"fit(run_name={run_name!r})"] if run_name is not None else []) + \
            [f"a logger's run_name={n!r}" for n in sorted(names)]
        raise ValueError(f"one run has one folder name, got {', '.join(given)}; give the name once (fit's "
                         "run_name) or the same name everywhere")
    return run_name if run_name is not None else next(iter(names), None)


def claim_run_folders(logger: Logger | None, name: str | None, default_name: str, *,
                      extra_roots: Sequence[str | os.PathLike] = (), overwrite: bool = False,
                      resume_after: int | None = None,
                      checkpoint_dir: str | os.PathLike | None = None) -> RunClaim | None:
    """Claim <root>/<name> for the run under every folder its loggers write (and extra_roots: the default
    checkpoint folder's logs/), before any node starts; hand the claimed name to the loggers. resume_after: the
    run continues in its own folder from its checkpoint at that step (rows after it are dropped). An ended run of
    the same explicit name is moved aside first, with its checkpoint_dir (exogym.runs.rerun), unless overwrite.
    None when nothing is written into a run folder."""
    loggers = _loggers(logger)
    folder_loggers = [lg for lg in loggers if isinstance(lg, _FolderLogger)]
    roots = [lg.log_dir for lg in folder_loggers] + [Path(r) for r in extra_roots]
    if name is not None and not overwrite and resume_after is None:
        keep_earlier_run([root / name for root in roots], name, checkpoint_dir)
    if not roots:
        return None
    claim = claim_run(roots, name, default_name, overwrite=overwrite, resume=resume_after is not None)
    for lg in folder_loggers:
        lg.run_name, lg.claim = claim.name, claim
        if resume_after is not None:
            lg.continue_after(resume_after)
    for lg in loggers:
        if isinstance(lg, WandbLogger) and lg.run_name is None:
            lg.run_name = claim.name  # wandb names its own folders with a unique run id; this is the display name
    return claim
