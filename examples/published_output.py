"""Where an example writes its outputs: under runs/ (git-ignored) by default, into docs/img only with --update-docs.

The JSON files (and plots) in docs/img are what README.md and docs/results.md quote, and a test reruns some of
them; running an example must neither dirty the clone nor replace them by accident. So:

- by default an example writes under runs/ (relative to the working directory; .gitignore lists it), whatever
  its settings;
- --out / --plot names an explicit path;
- --update-docs regenerates the published files: the same names in docs/img as before, and only for the
  published configuration (every option at its default, except the few an example lists as free, e.g.
  mnist.py's --seed and --published, each of which has its own published file). With any other setting it is
  refused before training starts, since it would replace the published numbers with another setting's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

__all__ = ["DOCS_IMG", "RUNS", "add_update_docs", "changed_options", "output_path", "print_outputs"]

DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
RUNS = Path("runs")  # relative to where the example is run; git-ignored
_PATH_OPTIONS = ("out", "plot", "update_docs")  # where the outputs go, not what is computed


def add_update_docs(parser: argparse.ArgumentParser, files: str) -> None:
    """Add --update-docs; `files` names what it writes in docs/img (for --help)."""
    parser.add_argument("--update-docs", action="store_true",
                        help=f"write the published files in docs/img ({files}; tracked by git, quoted by the docs) "
                             "instead of under runs/; only with the published settings (the other options at their "
                             "defaults), refused otherwise")


def changed_options(parser: argparse.ArgumentParser, args: argparse.Namespace, free: Iterable[str] = ()) -> list[str]:
    """The options set away from their defaults, as "--name value", ignoring the output options and `free`."""
    skip = {*_PATH_OPTIONS, *free}
    return [f"--{key.replace('_', '-')} {_shown(value)} (published: {_shown(parser.get_default(key))})"
            for key, value in vars(args).items() if key not in skip and value != parser.get_default(key)]


def output_path(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str, *, given: str | None = None,
                free: Iterable[str] = (), flag: str = "--out") -> Path:
    """Where the example writes its main file `name` (plots go next to it). Creates nothing.

    `given` (the value of `flag`, --out or --plot) if the user named a path; docs/img/<name> with --update-docs,
    which the published configuration alone may use (anything else exits through parser.error, before any
    training); runs/<name> otherwise. `free` lists the options that may differ from their defaults in a
    published run (they pick the file's name, e.g. mnist.py's seed)."""
    if not getattr(args, "update_docs", False):
        return Path(given) if given else RUNS / name
    if given:
        parser.error(f"--update-docs writes {_relative(DOCS_IMG / name)}; it cannot be combined with {flag}")
    changed = changed_options(parser, args, free)
    if changed:
        parser.error(f"--update-docs regenerates the published {_relative(DOCS_IMG / name)} and runs only with the "
                     f"published settings, but these differ: {'; '.join(changed)}. That would replace the published "
                     f"numbers with another setting's: drop --update-docs (the outputs then go under {RUNS}/), "
                     f"or {flag} PATH")
    return DOCS_IMG / name


def print_outputs(paths: Iterable[str | Path]) -> None:
    """The closing lines of a run: every file it wrote."""
    paths = [Path(p) for p in paths]
    print("\noutputs:")
    for path in paths:
        print(f"  {_relative(path)}")
    if not any(_inside(path, DOCS_IMG) for path in paths):
        print("(docs/img is unchanged: --update-docs regenerates the published files there)")


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder)


def _relative(path: Path) -> Path:
    """A path under the working directory as a relative one (runs/..., docs/img/...), any other as it is."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path
