"""`exogym ui` and `exogym trace`: the web view of a folder of runs, and a run's timeline as a Chrome trace file.

    exogym ui runs/ --port 8765                      # prints http://127.0.0.1:8765/?token=...
    exogym trace runs/mnist-diloco -o trace.json     # for Perfetto (ui.perfetto.dev) or chrome://tracing
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_ui_commands"]


def cmd_ui(args: argparse.Namespace) -> int:
    from exogym.ui.server import serve

    if not Path(args.root).is_dir():
        raise ValueError(f"exogym ui serves a folder of run folders; {args.root!r} is not a folder")
    try:
        serve(args.root, port=args.port, host=args.host)
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from exogym.runs.timeline import read_timeline
    from exogym.runs.trace import write_chrome_trace

    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"-o {args.out!r}: the folder {str(out.parent)!r} does not exist")
    path = write_chrome_trace(read_timeline(args.run), out)
    print(f"{path}: open it in Perfetto (ui.perfetto.dev) or chrome://tracing")
    return 0


def add_ui_commands(sub: Any, *, formatter_class: type) -> None:
    """Add `exogym ui` and `exogym trace` to the command's subparsers.

    Args:
        sub: The subparsers of the `exogym` parser.
        formatter_class: The help formatter the other commands use.
    """
    ui = sub.add_parser("ui", help="serve a web view of a folder of runs (runs, comparisons, timelines, sweeps)",
                        formatter_class=formatter_class,
                        description="Serve the runs under ROOT in a browser: the runs list (live while they train), "
                                    "curves of any selection, a run's timeline, the sweeps. It binds 127.0.0.1 and "
                                    "prints an address with a random token, which every request needs. Needs the ui "
                                    'extra: pip install "exogym[ui]".')
    ui.add_argument("root", help="the folder of run folders (and sweep folders)")
    ui.add_argument("--port", type=int, default=8765, help="the port (0: any free one)")
    ui.add_argument("--host", default="127.0.0.1",
                    help="the address to bind (other machines can reach the view only if you change it)")
    ui.set_defaults(func=cmd_ui)
    trace = sub.add_parser("trace", help="write a run's timeline as a Chrome trace event file (Perfetto)",
                           formatter_class=formatter_class,
                           description="Write the spans of a run folder's timeline.json (compute, comm, idle, down, "
                                       "slowed per node; messages; server updates) as Chrome trace events.")
    trace.add_argument("run", help="the run folder")
    trace.add_argument("-o", "--out", default="trace.json", help="the file to write")
    trace.set_defaults(func=cmd_trace)
