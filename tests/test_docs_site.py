"""The README a newcomer reads and the documentation site: the README's quick start runs as pasted, the README stays
short, and `mkdocs build --strict` (every page, every link, every API reference generated from the docstrings) passes."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 200


def _first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def _env() -> dict[str, str]:
    # Run from anywhere, as a user who installed the package; one thread keeps a 2-core machine's timing steady.
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_the_readme_is_read_in_five_minutes():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES}"


def test_the_readme_quick_start_runs_as_pasted(tmp_path):
    code = _first_python_block(README.read_text())
    lines = code.rstrip("\n").splitlines()
    assert 15 <= len(lines) <= 25, f"the quick start is {len(lines)} lines; a newcomer's first block is 15-25"
    assert "Trainer(" in code and ".fit(" in code, "the quick start must build a Trainer and call fit"
    (tmp_path / "quickstart.py").write_text(code)
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"the README's quick start failed:\n{done.stdout}\n{done.stderr}"


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
                    reason='the documentation site needs mkdocs and mkdocstrings: pip install -e ".[docs]"')
def test_the_documentation_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    site = tmp_path / "site"
    for page in ("index.html", "guide/index.html", "design/index.html", "api/trainer/index.html"):
        assert (site / page).is_file(), page
    # The API reference is generated from the docstrings, not left as ::: directives.
    api = (site / "api" / "trainer" / "index.html").read_text()
    assert "exogym.Trainer" in api and ":::" not in api
