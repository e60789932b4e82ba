"""The `exogym` command: `run`, `compare` and `plot` (commands.py, whose `main` is the console script), `sweep`
(sweep.py), `data` (data.py), `ui` and `trace` (ui.py), and the built-in tasks they train on (tasks.py)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The `exogym` command (exogym.cli.commands.main); kept here for console scripts installed before exogym.cli
    became a package (their entry point reads `exogym.cli:main`), imported only when called."""
    from exogym.cli.commands import main as run_command
    return run_command(argv)
