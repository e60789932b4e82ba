"""The package's shape, read from its own imports (ast): the compatibility layer sits on top of the core, and no
module imports another that imports it back (directly or around a circle)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exogym"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every exogym module the file imports, at any depth of the file (function-level imports count too)."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_only_the_package_face_imports_the_compatibility_layer():
    offenders = sorted(f"{m} imports {sorted(i for i in deps if i.startswith('exogym.compat'))}"
                       for m, deps in _graph().items()
                       if m != "exogym" and not m.startswith("exogym.compat")
                       and any(i.startswith("exogym.compat") for i in deps))
    assert not offenders, offenders


def test_the_graph_reader_sees_imports_of_every_form(tmp_path):
    # The check above must be able to fail: a module importing compat in each way Python allows is seen.
    for line in ("import exogym.compat", "from exogym.compat import spellings", "from exogym.compat.fit import x",
                 "def f():\n    from exogym.compat import old_paths"):
        f = tmp_path / "m.py"
        f.write_text(line + "\n")
        assert any(i.startswith("exogym.compat") for i in _imports(f)), line


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    # A package's __init__ re-exporting its modules is the package's face, not an edge back into it.
    graph = {m: {d for d in deps if not m.startswith(d + ".") and d != m} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_top_of_the_package_holds_packages_and_the_two_modules_below_every_layer():
    # fit/ and cli/ hold what were fourteen loose modules; the argument checks and the adapters' hook stay at the top
    # because every layer imports them (they import no exogym module: the test below).
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "_validation.py", "adapters.py"]
    graph = _graph()
    assert graph["exogym._validation"] == set() and graph["exogym.adapters"] == set()


def test_no_layer_below_fit_imports_fit_or_the_command_line():
    above = ("exogym.fit", "exogym.cli", "exogym.compat", "exogym.sweep")  # sweep and compat sit on top, like cli
    offenders = sorted(f"{m} imports {i}" for m, deps in _graph().items() for i in deps
                       if m != "exogym" and not any(_within(m, a) for a in above)
                       and (_within(i, "exogym.fit") or _within(i, "exogym.cli")))
    offenders += sorted(f"{m} imports {i}" for m, deps in _graph().items() if _within(m, "exogym.fit") for i in deps
                        if _within(i, "exogym.cli") or _within(i, "exogym.sweep") or _within(i, "exogym.compat"))
    assert offenders == []
