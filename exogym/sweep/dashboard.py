"""`exogym sweep dashboard FOLDER|URL`: the sweep's study served by optuna-dashboard, in a browser.

A sweep folder's study (its journal file, or the database its sweep.json names) or a database URL is served
as it is: every trial with its configuration, state, reason, objective and each seed's outcome (user attributes
`run:<seed>`, with the bytes a node sent and the simulated time), refreshed while the sweep runs; beside it its
loss-vs-bytes view (`<study>.pareto`, two objectives: the dashboard draws its Pareto front). A sweep folder whose
study was made before the view gets it when its dashboard starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exogym.sweep.storage import INSTALL, check_url, import_optuna, open_storage, shown_url

__all__ = ["serve", "dashboard_storage"]


def dashboard_storage(target: str) -> tuple[Any, str]:
    """(the storage optuna-dashboard serves, how to name it) for a sweep folder or a database URL."""
    from exogym.sweep.sweep import read_definition

    if "://" in target:
        check_url(target)
        return target, shown_url(target)
    if not Path(target).is_dir():
        raise FileNotFoundError(f"{target!r} is neither a sweep folder nor a database URL (postgresql://...)")
    definition = read_definition(target)
    definition.open_study().open_pareto()  # a study made before the loss-vs-bytes view gets it here
    storage = open_storage(definition.storage, folder=definition.path, heartbeat=definition.heartbeat,
                           grace=definition.grace, max_retry=definition.max_retry)
    return storage, definition.shown_storage


def serve(target: str, *, host: str = "127.0.0.1", port: int = 8080) -> int:
    """Serve the study of `target` (a sweep folder or a database URL) until Ctrl-C; returns the exit status."""
    import_optuna("the dashboard")
    try:
        import optuna_dashboard
    except ImportError as e:
        raise ImportError(f"the dashboard needs optuna-dashboard: {INSTALL}") from e
    storage, shown = dashboard_storage(target)
    print(f"exogym sweep dashboard: {shown} at http://{host}:{port}/ (Ctrl-C stops it)", flush=True)
    try:
        optuna_dashboard.run_server(storage, host=host, port=port)
    except KeyboardInterrupt:
        return 0
    return 0
