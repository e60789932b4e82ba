"""Load a script of examples/ as a module (examples/ is a folder of scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:  # examples import their folder's helpers, as they do when run as scripts
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"exogym_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
