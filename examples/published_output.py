"""Where an example writes its numbers: docs/img for the run that makes the published table, runs/ otherwise.

The JSON files (and plots) in docs/img are what README.md and docs/results.md quote, and a test reruns some
of them; a quick look with other settings must never replace them. So an example writes into docs/img only
when every option is at its default (the published run), and under runs/ (git-ignored) for anything else,
unless --out / --plot says where.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["DOCS_IMG", "output_path"]

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"


def output_path(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, *,
                given: str | None = None) -> Path:
    """`given` if the user named a path; else docs/img/<name> for the published run, runs/<name> otherwise."""
    if given:
        return Path(given)
    published = all(value == parser.get_default(key) for key, value in vars(args).items()
                    if key not in ("out", "plot"))
    folder = DOCS_IMG if published else Path("runs")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name
