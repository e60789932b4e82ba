"""Every code block of README.md and docs/*.md runs as pasted, each page's blocks in order (Sybil parses the pages).

Why Sybil: it is kept up (releases through 2026), parses Markdown fences with their line numbers, and keeps one
namespace per page that its blocks run in, in order, which is how a reader pastes them; pytest-markdown-docs
reruns every earlier block of a page for a block that continues them (the training blocks would run again and
again), and mktestdocs has no per-block line numbers in its failures. The test is ours (one test per page, new pages
found by the glob), so that the rules below are checked, not only run.

The rules:
- python: a block starts from an empty namespace (`__name__ == "__main__"`, as a pasted script), unless its first
  line is a comment saying it continues (`# continues ...`): then it runs in the namespace the page's blocks before
  it left (every earlier block's names, as in one session where a reader pasted them all in order). A block that
  is a file for another launcher (its first line `# <name>.py`: a script torchrun starts on several processes) is
  not run; ruff checks it for syntax and undefined names (F821, F822). `--8<-- "file:section"` lines are expanded
  as the site's snippets extension expands them, so the block runs as the built site shows it.
- bash: each command line is classified (`_COMMANDS`): `exogym data ...` runs (seconds); other `exogym ...` lines are
  parsed by the command's own parser (each option exists and parses: the sweeps there train for minutes to hours);
  the rest is not run, for the reason listed with it. A command line of no listed kind fails the test.
- Blocks without a language are program output or layouts; they are not code.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sybil import Document, Example
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_CONTINUES = re.compile(r"#\s*continues\b", re.I)
_FILE = re.compile(r"#\s*[\w./-]+\.py\s*$")
_SNIPPET = re.compile(r'^-{1,3}8<-{1,3}\s+"([^"]+)"\s*$', re.M)

# bash lines not run, by their start, and why
_NOT_RUN = {
    "pip install": "installs packages (CI installs the dev extra before the suite)",
    "python -m pytest": "the suite itself",
    "for i in": "the fault loop: the suite's fault tests, ten times over",
    "mkdocs": "tests/test_docs_site.py builds the site strictly",
    "torchrun": "several processes or machines; tests/test_torchrun*.py launch torchrun on this machine",
    "sudo": "database administration on the database server",
    "python examples/": "a measurement of minutes to hours; tests/test_published_numbers.py reruns their start",
    "OMP_NUM_THREADS=1 python examples/": "a measurement of minutes to hours (as python examples/)",
    "python benchmarks/": "a benchmark (minutes; benchmarks print tables, tests never time)",
    "python mnist.py": "the original EXO Gym's scripts: tests/spellings/test_original_repository_scripts.py",
    "python nanogpt_train.py": "the original EXO Gym's scripts (as python mnist.py)",
    "python playground.py": "the original EXO Gym's scripts (as python mnist.py)",
    "python diloco_scaling.py": "the original EXO Gym's scripts (as python mnist.py)",
    "python image_train.py": "the original EXO Gym's scripts (as python mnist.py)",
}


def _spawns(page: Path) -> bool:
    """A page whose blocks start processes: the torch backend, processes=, a sweep's workers, `exogym data`."""
    fences = _fences(page.read_text())
    python = "".join(body for lang, body in fences if lang == "python" and not _FILE.match(body.lstrip()))
    bash = "".join(body for lang, body in fences if lang in ("bash", "sh", "shell"))
    return bool(re.search(r'backend="torch"|processes=[2-9]|workers=[2-9]', python)
                or re.search(r"^exogym data ", bash, re.M))


def _fences(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)]


def _expand_snippets(source: str) -> str:
    """`--8<-- "path:section"` as pymdownx.snippets expands it: the lines between the section's markers."""
    def include(m: re.Match) -> str:
        path, _, section = m.group(1).partition(":")
        lines = (ROOT / path).read_text().splitlines(keepends=True)
        if not section:
            return "".join(lines)
        start = next(i for i, line in enumerate(lines) if f"--8<-- [start:{section}]" in line)
        end = next(i for i, line in enumerate(lines) if f"--8<-- [end:{section}]" in line)
        return "".join(lines[start + 1:end])
    return _SNIPPET.sub(include, source)


def _blocks(page: Path) -> Document:
    """The page's fenced blocks as Sybil examples, each with its language in `region.parsed[0]`."""
    document = Document(page.read_text(), str(page))
    lexer = FencedCodeBlockLexer(language=r".*", mapping={"language": "arguments", "source": "source"})
    for region in lexer(document):
        language = (region.lexemes["arguments"] or "").split()[0] if region.lexemes["arguments"] else ""
        region.parsed = (language, region.lexemes["source"])
        region.evaluator = _evaluate
        document.add(region)
    return document


def _evaluate(example: Example) -> None:
    __tracebackhide__ = True
    language, source = example.parsed
    if language == "python":
        _python(example, str(source))
    elif language in ("bash", "sh", "shell"):
        _bash(example, str(source))


def _python(example: Example, source: str) -> None:
    __tracebackhide__ = True
    first = source.lstrip().splitlines()[0] if source.strip() else ""
    if _FILE.match(first):
        _check_file(example, source)
        return
    code = compile("\n" * example.line + _expand_snippets(source), example.path, "exec")
    if _CONTINUES.match(first):
        exec(code, example.namespace)
        return
    alone = {"__name__": "__main__"}  # it must run on its own; what it defines joins the page's session after
    exec(code, alone)
    example.namespace.update(alone)


def _check_file(example: Example, source: str) -> None:
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F821,F822", "--stdin-filename",
                            "block.py", "--output-format", "concise", "-"], input=source, capture_output=True,
                           text=True)
    assert found.returncode == 0, f"{example.path}:{example.line}: the file block does not run:\n{found.stdout}"


def _bash(example: Example, source: str) -> None:
    from exogym.cli.commands import build_parser
    lines = re.sub(r"\\\n\s*", " ", source).splitlines()
    for line in (ln.split(" #")[0].strip() for ln in lines):
        if not line or line.startswith("#"):
            continue
        if line.startswith("exogym "):
            argv = shlex.split(line)[1:]
            if argv[0] == "data":  # seconds: run it as pasted
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                                  os.environ.get("PYTHONPATH")]))}
                done = subprocess.run([sys.executable, "-m", "exogym.cli", *argv], env=env, capture_output=True,
                                      text=True, timeout=300)
                assert done.returncode == 0, f"{example.path}:{example.line}: {line}\n{done.stderr}"
            else:  # training for minutes or hours: every option exists and parses
                try:
                    build_parser().parse_args(argv)
                except SystemExit:
                    pytest.fail(f"{example.path}:{example.line}: `{line}` does not parse")
            continue
        assert any(line.startswith(kind) for kind in _NOT_RUN), (
            f"{example.path}:{example.line}: `{line}` is of no kind this test knows: run it here, or add it to "
            "_NOT_RUN with the reason it is not run")


@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(ROOT)),
                                               marks=[pytest.mark.spawns] if _spawns(p) else [])
                                  for p in PAGES])
def test_every_block_of_the_page_runs_as_pasted(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what the blocks write (logs/, sweeps/, data/) stays out of the repository
    for example in _blocks(page):
        example.evaluate()


def test_a_block_that_uses_an_earlier_ones_names_must_say_it_continues(tmp_path):
    # The rule can fail: a page whose second block uses the first's name without saying so raises NameError.
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nprint(x)\n```\n\n```python\n# continues\nprint(x)\n```\n")
    blocks = list(_blocks(page))
    blocks[0].evaluate()
    with pytest.raises(NameError):
        blocks[1].evaluate()
    page.write_text("```python\nx = 1\n```\n\n```python\n# continues the block above\nprint(x)\n```\n")
    for example in _blocks(page):
        example.evaluate()


def test_a_bash_line_of_no_known_kind_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nexogym run --nodes 2 --no-such-option\n```\n")
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        for example in _blocks(page):
            example.evaluate()
    page.write_text("```bash\nrm -rf build\n```\n")
    with pytest.raises(AssertionError, match="of no kind this test knows"):
        for example in _blocks(page):
            example.evaluate()
