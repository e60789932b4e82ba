"""The README a newcomer reads and the documentation site: the README's quick start runs as pasted, the README stays
short, `mkdocs build --strict` (every page, every link, every API reference generated from the docstrings) passes,
and the API reference reads: every public class and function of the documented modules has a Google-style docstring
with an Args entry for each of its arguments, and no docstring leaks raw HTML or a stray admonition into a page.

The API checks walk the objects themselves (griffe, the loader mkdocstrings uses), not a list kept here: every
`::: path` directive of docs/api/*.md, the `__all__` of each module those directives name objects through, and the
public methods of every such class. A class or function added to one of those `__all__` is checked the day it lands."""

import collections
import html
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
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


def test_the_readme_quick_start_is_a_newcomers_first_block():
    # It runs as pasted with every other block of the README: tests/test_docs_snippets.py.
    code = _first_python_block(README.read_text())
    lines = code.rstrip("\n").splitlines()
    assert 15 <= len(lines) <= 25, f"the quick start is {len(lines)} lines; a newcomer's first block is 15-25"
    assert "Trainer(" in code and ".fit(" in code, "the quick start must build a Trainer and call fit"


_HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None and importlib.util.find_spec("mkdocstrings") is not None
_needs_mkdocs = pytest.mark.skipif(
    not _HAS_MKDOCS, reason='the documentation site needs mkdocs and mkdocstrings: pip install -e ".[docs]"')
API_PAGES = ROOT / "docs" / "api"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module's tests (a few seconds)."""
    out = tmp_path_factory.mktemp("site") / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


@_needs_mkdocs
@pytest.mark.spawns  # the site is built by mkdocs in a process
def test_the_documentation_site_builds_strictly(site):
    for page in ("index.html", "guide/index.html", "design/index.html", "api/trainer/index.html"):
        assert (site / page).is_file(), page
    # The API reference is generated from the docstrings, not left as ::: directives.
    api = (site / "api" / "trainer" / "index.html").read_text()
    assert "exogym.Trainer" in api and ":::" not in api


# --- The API reference reads -------------------------------------------------------------------------------------

# What Markdown and mkdocstrings write inside an object's documentation. Any other tag there is raw HTML that a
# docstring let through: `<run_name>` becomes an unknown element and shows as nothing, `<a checkpoint, ...>` an
# open link that swallows the rest of the page.
_RENDERED_TAGS = {"p", "a", "code", "pre", "span", "div", "em", "strong", "ul", "ol", "li", "table", "thead", "tbody",
                  "tr", "th", "td", "h2", "h3", "h4", "h5", "h6", "details", "summary", "br", "hr", "blockquote",
                  "small", "sup", "sub", "img", "kbd", "b", "i", "abbr", "autoref"}
_VOID_TAGS = {"br", "hr", "img", "input", "meta", "link", "wbr", "col", "source"}
# Google-style admonitions a docstring may mean ("Note:", "Warning:", ...). Any other `Word:` line followed by an
# indented block is read as an admonition titled Word (DiLoCo's "H:" became a note box).
_ADMONITIONS = {"note", "notes", "warning", "warnings", "tip", "tips", "important", "caution", "danger", "attention",
                "hint", "example", "examples", "info", "see also", "seealso", "todo"}


class _DocContents(HTMLParser):
    """Collects, for an API page, the raw HTML inside the documentation of each object (its `doc-contents`),
    named by the heading (the object's path) it falls under."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # one per open element: (tag, is it an object's doc-contents?)
        self.heading = "(top of the page)"
        self.problems: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if re.fullmatch(r"h[2-6]", tag) and "doc-heading" in classes and attrs.get("id"):
            self.heading = attrs["id"]
        if any(inside for _, inside in self.stack):
            if tag not in _RENDERED_TAGS:
                self.problems.append(f"{self.heading}: raw HTML <{tag}> (write it in backticks)")
            elif tag == "a" and "href" not in attrs and "id" not in attrs:
                self.problems.append(f"{self.heading}: raw HTML <a {' '.join(attrs)}> (write it in backticks)")
            elif (tag == "div" and "admonition" in classes) or tag == "details":
                kind = next((c for c in classes if c != "admonition"), "")
                if kind.lower() not in _ADMONITIONS:
                    self.problems.append(f"{self.heading}: an admonition box {kind!r}, made from a line "
                                         f"'{kind}:' (Google style reads `Word:` as a section; reword the line)")
        if tag not in _VOID_TAGS:
            self.stack.append((tag, "doc-contents" in classes))

    def handle_endtag(self, tag):
        # Up to the element this closes: a raw tag a docstring left open (<run_name>) is closed with it.
        if any(open_tag == tag for open_tag, _ in self.stack):
            while self.stack.pop()[0] != tag:
                pass


@_needs_mkdocs
@pytest.mark.spawns  # the site is built by mkdocs in a process
def test_api_pages_hold_no_raw_html_from_docstrings(site):
    pages = sorted((site / "api").glob("*/index.html"))
    assert len(pages) == len(list(API_PAGES.glob("*.md"))), [p.parent.name for p in pages]
    problems = []
    for page in pages:
        parser = _DocContents()
        parser.feed(page.read_text())
        problems += [f"api/{page.parent.name}: {p}" for p in parser.problems]
    assert not problems, "the API reference shows what a docstring did not mean:\n" + "\n".join(problems)


def _signatures(site: Path) -> list[tuple[str, str]]:
    """Every rendered signature of the API pages as text: (page, signature)."""
    return [(page.parent.name, html.unescape(re.sub(r"<[^>]+>", "", signature)))
            for page in sorted((site / "api").glob("*/index.html"))
            for signature in re.findall(r'doc-signature[^>]*><pre>(.*?)</pre>', page.read_text(), re.S)]


@_needs_mkdocs
@pytest.mark.skipif(importlib.util.find_spec("ruff") is None and importlib.util.find_spec("black") is None,
                    reason='mkdocstrings wraps signatures with ruff or black: pip install -e ".[docs]"')
@pytest.mark.spawns  # the site is built by mkdocs in a process
def test_long_signatures_wrap(site):
    # fit's 41 keywords once made one 1,445-character line; mkdocs.yml's line_length is 88.
    long_lines = [f"api/{page}: {line[:60]}... ({len(line)} characters)" for page, text in _signatures(site)
                  for line in text.splitlines() if len(line) > 100]
    assert not long_lines, "signatures that do not wrap:\n" + "\n".join(long_lines)


def _api_objects():
    """What the API pages document, walked with griffe: (label, object) for each `::: path` directive's object (a
    module's: its docstring and its `members` option, else its `__all__`), each class and function in the
    `__all__` of the modules the directives name objects through, and the public methods of each such class (its
    own, and those it inherits from a private base); then the exports that no page shows, with their page."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], docstring_parser=griffe.Parser.google)
    loader.load("exogym")
    loader.resolve_aliases(implicit=False, external=False)

    def get(path):
        try:
            obj = loader.modules_collection[path]
        except KeyError:  # a name griffe cannot see statically (a constant built at import time)
            return None
        return obj.final_target if obj.is_alias else obj

    roots, modules, rendered, exported = [], {}, set(), []
    for page in sorted(API_PAGES.glob("*.md")):
        for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+\S.*\n)*)", page.read_text(), re.M):
            path, options = m.group(1), m.group(2)
            obj = get(path)
            if obj.is_module:
                listed = re.findall(r"^\s+- (\w+)\s*$", options, re.M)
                names = listed or importlib.import_module(path).__all__  # a module shows its __all__
                for name in names:
                    rendered.add(f"{path}.{name}")
                    member = get(f"{path}.{name}")
                    if member is not None and (member.is_class or member.is_function):
                        roots.append((f"{path}.{name}", member))
                roots.append((path, obj))  # its docstring shows too
                modules.setdefault(path, collections.Counter())[page.name] += len(names)
            else:
                rendered.add(path)
                roots.append((path, obj))
                modules.setdefault(path.rsplit(".", 1)[0], collections.Counter())[page.name] += 1
    for module in modules:
        for name in importlib.import_module(module).__all__:
            obj = get(f"{module}.{name}")
            if obj is not None and (obj.is_class or obj.is_function):
                roots.append((f"{module}.{name}", obj))
                exported.append((f"{module}.{name}", modules[module].most_common(1)[0][0]))  # its usual page
    seen, out = set(), []

    def walk(label, obj):
        if obj.path in seen:
            return
        seen.add(obj.path)
        out.append((label, obj))
        if obj.is_class:  # its public methods, and those it inherits from a private base (shown as its own)
            for name, member in obj.all_members.items():
                target = member.final_target if member.is_alias else member
                own = target.parent is obj or (target.parent.is_class and target.parent.name.startswith("_")
                                               and target.parent.path.startswith("exogym."))
                if not name.startswith("_") and own and (target.is_function or "property" in target.labels):
                    walk(f"{label}.{name}", target)  # (a property: its docstring; it takes no argument)

    for label, obj in roots:
        walk(label, obj)
    shown = {obj.path for obj in map(get, rendered) if obj is not None}  # through any import path
    missing = [(path, page) for path, page in exported if path not in rendered and get(path).path not in shown]
    return griffe, out, missing


def _inherits_doc(obj) -> bool:
    """A method without a docstring of its own that overrides a documented one reads as that one (inspect.getdoc)."""
    if not obj.parent or not obj.parent.is_class:
        return False
    for base in obj.parent.mro():
        member = base.members.get(obj.name)
        if member is not None and member.docstring is not None and member.docstring.value.strip():
            return True
    return False


def _signature(obj):
    """The arguments a reader passes: a function's, or a class's `__init__`'s (mkdocstrings merges it into the
    class), except self/cls and private ones."""
    function = obj.members.get("__init__") if obj.is_class else obj
    # (an inherited __init__ is checked on the class that declares it; a property takes no argument)
    if function is None or function.is_alias or "property" in function.labels:
        return []
    params = list(function.parameters)
    if params and function.parent.is_class and "staticmethod" not in function.labels:
        params = params[1:]  # self, or cls of a classmethod
    return [p for p in params if not p.name.startswith("_")]


def _docstring_problems(griffe, label, obj) -> list[str]:
    docstring = obj.docstring
    if obj.is_module and docstring is None:
        return []
    if obj.is_class and (docstring is None or not docstring.value.strip()):
        init = obj.members.get("__init__")
        docstring = init.docstring if init is not None and not init.is_alias else None
    if docstring is None or not docstring.value.strip():
        return [] if obj.is_function and _inherits_doc(obj) else [f"{label}: no docstring"]
    problems, documented = [], set()
    texts = [docstring]
    if obj.is_class and "__init__" in obj.members and not obj.members["__init__"].is_alias:
        init_doc = obj.members["__init__"].docstring
        texts += [init_doc] if init_doc is not None else []
    for text in texts:
        for section in text.parse(griffe.Parser.google, warn_unknown_params=False, warnings=False):
            kind = section.kind.value
            if kind in ("parameters", "other parameters") or (kind == "attributes" and "dataclass" in obj.labels):
                # (a dataclass's arguments are its fields: an Attributes entry documents one)
                documented |= {p.name.lstrip("*") for p in section.value}
            elif kind == "admonition" and section.title.lower() not in _ADMONITIONS:
                problems.append(f"{label}: the line '{section.title}:' becomes an admonition box titled "
                                f"{section.title!r}; reword it (Google style reads `Word:` as a section)")
        # Raw HTML outside code: `<run_name>` renders as nothing, `<a checkpoint, ...>` as a link eating the page.
        prose = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", text.value, flags=re.S))
        for tag in re.findall(r"<[/a-zA-Z!?][^<>\n]*>", prose):
            problems.append(f"{label}: raw HTML {tag!r} in the docstring; write placeholders in backticks")
    names = [] if obj.is_module else [p.name for p in _signature(obj)]
    for name in names:
        if name not in documented:
            problems.append(f"{label}: argument {name!r} has no entry under Args")
    for name in sorted(documented - set(names)):
        if names or obj.is_function:  # (a class whose __init__ is inherited documents that one's arguments)
            problems.append(f"{label}: Args documents {name!r}, which it does not take")
    return problems


@pytest.mark.spawns
def test_every_public_argument_has_an_args_entry():
    griffe, objects, _ = _api_objects()
    assert len(objects) > 50, [label for label, _ in objects]  # the walk found the API, not an empty list
    problems = [p for label, obj in objects for p in _docstring_problems(griffe, label, obj)]
    assert not problems, (f"{len(problems)} problems in the docstrings of the documented API (Google style: a "
                          f"summary line, then Args:/Returns:/Raises: sections):\n" + "\n".join(problems))


@pytest.mark.spawns
def test_every_export_of_a_documented_module_is_on_an_api_page():
    """A class or function added to the `__all__` of a module the API pages document (exogym, exogym.strategy,
    exogym.runs.loggers, ...) appears in the reference, not only in the code."""
    _, _, missing = _api_objects()
    assert not missing, "exported but not in the API reference (add a `::: path` line to the page):\n" + "\n".join(
        f"{path}: docs/api/{page}" for path, page in missing)


@_needs_mkdocs
@pytest.mark.spawns  # the site is built by mkdocs in a process
def test_signatures_show_default_values_not_constant_names(site):
    # fit's node_timeout=DEFAULT_NODE_TIMEOUT rendered as a clipped `DEFAULT_NODE_TI...`: a reader needs the value.
    names = [f"api/{page}: {m}" for page, text in _signatures(site)
             for m in re.findall(r"\w+\s*=\s*[A-Z][A-Z0-9]*_[A-Z0-9_]+\b", text)]  # (op=SUM is its value)
    assert not names, "defaults shown as constant names:\n" + "\n".join(names)


def test_fits_default_timeouts_are_the_backends():
    import inspect

    from exogym import Trainer
    from exogym.backends.errors import DEFAULT_NODE_TIMEOUT
    from exogym.backends.peer_watch import DEFAULT_PEER_TIMEOUT
    shown = inspect.signature(inspect.unwrap(Trainer.fit)).parameters
    assert (shown["node_timeout"].default, shown["peer_timeout"].default) == (DEFAULT_NODE_TIMEOUT, DEFAULT_PEER_TIMEOUT)
