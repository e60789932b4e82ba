"""Every spelling of the original EXO Gym and of diloco-sim, on top of the core.

The core never imports this package (a test reads every module's imports). It adapts the core's public calls
through the core's neutral hook (exogym.adapters): the original's keyword names, fit's original order and
keywords, strategy keyword forms; it writes the original's run files (exogym.compat.run_files, a table view of the
CSV logger), gives Strategy the methods the original's skeletons call (exogym.compat.strategy_api), and keeps old
import paths working (exogym.compat.old_paths). `import exogym` installs it, last. docs/coming_from_exogym.md lists
every spelling.
"""

from exogym.compat import fit, old_paths, run_files, spellings, strategy_api

__all__ = ["install"]

_installed = False


def install() -> None:
    """Register every spelling (once per process)."""
    global _installed
    if _installed:
        return
    spellings.install()
    fit.install()
    run_files.install()
    strategy_api.install()
    old_paths.install()
    _installed = True
