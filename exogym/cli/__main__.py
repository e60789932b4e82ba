"""`python -m exogym.cli ...`: the `exogym` command."""

import sys

from exogym.cli.commands import main

sys.exit(main())
