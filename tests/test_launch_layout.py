"""The launch layer's shape, read from the package's imports (ast, as tests/test_layout.py reads them): a backend
runs inside one process and imports neither another backend nor the launch layer above it; the torchrun environment
is read in one module."""

import ast
from pathlib import Path

from exogym.backends.hosting import SERVER_ROLE, block_of, blocks
from exogym.launch.environment import detect_environment
from exogym.launch.launchers import layout

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "exogym"
BACKENDS = ("exogym.backends.sim", "exogym.backends.torch")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def _offenders(rule) -> list[str]:
    return sorted(f"{_module(p)} imports {i}" for p in PACKAGE.rglob("*.py") for i in _imports(p)
                  if i.startswith("exogym") and rule(_module(p), i))


def _backend_of(module: str) -> str | None:
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def test_no_backend_imports_another_backend():
    assert _offenders(lambda m, i: _backend_of(m) and _backend_of(i) and _backend_of(m) != _backend_of(i)) == []


def test_no_backend_imports_the_launch_layer():
    assert _offenders(lambda m, i: m.startswith("exogym.backends") and i.startswith("exogym.launch")) == []


def test_the_rule_readers_can_fail():
    assert _backend_of("exogym.backends.sim.run") == "exogym.backends.sim"
    assert _backend_of("exogym.backends.hosting") is None
    assert _offenders(lambda m, i: m == "exogym.fit.trainer" and i.startswith("exogym.launch"))  # the trainer does


def test_torchruns_variables_are_read_in_one_module():
    readers = sorted(_module(p) for p in PACKAGE.rglob("*.py")
                     if any(f'"{name}"' in p.read_text() for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")))
    assert readers == ["exogym.launch.environment"]


def test_each_process_hosts_a_block_and_node_zeros_process_hosts_the_extra_roles():
    hosting = layout(5, 2, roles=frozenset({SERVER_ROLE}))
    assert [list(h.nodes) for h in hosting] == [[0, 1, 2], [3, 4]] == [list(b) for b in blocks(5, 2)]
    assert [h.roles for h in hosting] == [frozenset({SERVER_ROLE}), frozenset()]
    assert all(h.owner == tuple(block_of(5, 2)) and h.processes == 2 for h in hosting)
    assert [list(h.nodes) for h in layout(3, 3)] == [[0], [1], [2]]


def test_the_environment_is_a_torchrun_launch_only_with_rank_and_world_size():
    assert not detect_environment({}).torchrun and detect_environment({}).world_size == 1
    env = detect_environment({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert (env.torchrun, env.rank, env.world_size, env.local_rank, env.main_port) == (True, 1, 4, 1, 29500)
    assert not env.is_main and env.nodes_on_this_machine(10) == 5
    share = detect_environment({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"})  # a machine's share, no launch
    assert not share.torchrun and share.nodes_on_this_machine(400) == 100
