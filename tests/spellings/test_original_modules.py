"""Every module path and name the original EXO Gym's README.md and llms.txt document imports here, or is listed on
docs/coming_from_exogym.md with what to write instead. The test reads both files where they are kept beside the
project (../shared/original-exogym, or $EXOGYM_ORIGINAL); it is skipped, saying so, where they are not."""

import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORIGINAL = Path(os.environ.get("EXOGYM_ORIGINAL", ROOT.parent / "shared" / "original-exogym"))
PAGE = (ROOT / "docs" / "coming_from_exogym.md").read_text()
# Names the documents use that are not the original package's own: torch's, and its example/ folder's model code.
NOT_THE_PACKAGES = {"Dataset": "torch.utils.data", "DistributedSampler": "torch.utils.data",
                    "ModelWrapper": "example/mnist.py", "GPTConfig": "example/nanogpt", "GPT": "example/nanogpt",
                    "None": "Python"}


def _documents():
    files = [ORIGINAL / "README.md", ORIGINAL / "llms.txt"]
    if not all(f.is_file() for f in files):
        pytest.skip(f"the original EXO Gym's README.md and llms.txt are not at {ORIGINAL} (set EXOGYM_ORIGINAL)")
    return {f.name: f.read_text() for f in files}


def _imports(text):
    """(module, name or None) of every `from exogym... import a, b` and `import exogym...` line."""
    out = []
    for module, names in re.findall(r"^\s*from (exogym[\w.]*) import ([\w, ]+)", text, re.M):
        out += [(module, n.strip()) for n in names.split(",") if n.strip()]
    out += [(m, None) for m in re.findall(r"^\s*import (exogym[\w.]*)", text, re.M)]
    out += [(m, None) for m in re.findall(r"`(exogym(?:\.\w+)+)(?:\.\*)?`", text)]
    return out


def _module_files(text):
    """The package's module files the documents name: `exogym/x.py`, `strategy/x.py`, and the appendix's bare names
    under **`exogym/`** (not those under **`example/`**, the original's scripts)."""
    out, section = [], None
    for line in text.splitlines():
        heading = re.search(r"\*\*`(\w+)/`\*\*", line)
        if heading:
            section = heading.group(1)
        for path in re.findall(r"[`(]((?:\w+/)*\w+\.py)[`)]", line):
            if path.startswith("example/") or (section == "example" and "/" not in path):
                continue
            path = path if path.startswith("exogym/") else ("exogym/strategy/" + path if "/" not in path and
                                                          section is None else "exogym/" + path)
            out.append(path[:-len(".py")].replace("/", "."))
    return out


def _names(text):
    """Backticked class names (`TrainNode`, `RandomIndexSelector(p)`, `OptimSpec.from_string(...)`)."""
    return set(re.findall(r"`([A-Z]\w*[a-z]\w*)[(.`]", text))


def _imports_or_listed(module, name=None):
    spelled = f"{module}.{name}" if name else module
    try:
        obj = importlib.import_module(module)
        if name is None or hasattr(obj, name):
            return True
    except ImportError:
        pass
    return f"`{spelled}`" in PAGE or (name is not None and f"`{name}`" in PAGE)


def test_every_import_line_imports_or_is_listed():
    missing = [f"{d}: from {m} import {n}" for d, text in _documents().items() for m, n in _imports(text)
               if not _imports_or_listed(m, n)]
    assert not missing


def test_every_module_file_imports_or_is_listed():
    modules = {m for text in _documents().values() for m in _module_files(text)}
    assert {"exogym.trainer", "exogym.train_node", "exogym.common", "exogym.strategy.demo_impl.demo"} <= modules
    missing = [m for m in sorted(modules) if not _imports_or_listed(m)]
    assert not missing


def test_every_class_name_imports_or_is_listed():
    texts = _documents()
    modules = ["exogym", "exogym.strategy"] + sorted({m for t in texts.values() for m in _module_files(t)} |
                                                     {m for t in texts.values() for m, _ in _imports(t)})
    found = set()
    for module in modules:
        try:
            found |= set(dir(importlib.import_module(module)))
        except ImportError:
            continue
    names = set().union(*(_names(t) for t in texts.values())) - set(NOT_THE_PACKAGES)
    assert {"TrainNode", "IndexSelector", "PartitionedIndexSelector", "TrainConfig"} <= names
    missing = sorted(n for n in names if n not in found and f"`{n}`" not in PAGE)
    assert not missing


def test_the_internals_llms_txt_names_are_listed():
    private = set(re.findall(r"`(_\w+)[(`]", _documents()["llms.txt"]))
    assert {"_build_connection", "_average_model_states"} <= private
    assert not sorted(n for n in private if f"`{n}`" not in PAGE)
