"""The house's floors, read from the source: which module may import which, no import cycles, modules
readable in one sitting.

Floors, top to bottom: `bertfast.tools` (commands) -> the product at the top of `bertfast/` -> `backends`
-> `kernels`. A module imports only from its own floor or below; the product never imports the oracle
`bertfast.reference` (only the torch backend wraps it, and tools and tests use it). Every import counts,
function-local ones included, so a cycle cannot hide behind a deferred import.

The tests keep one rule of their own: no module under tests/ imports a test module; what several test modules
share lives in conftest.py, modern_models.py and tests/helpers/.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "bertfast"
MAX_LINES = 450


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The bertfast modules `name` imports (a `from pkg import x` counts as pkg.x when that is a module)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                 and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only:  # annotations only: not a dependency at run time
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target.startswith("bertfast") and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _floor(name: str) -> int:
    """3 tools, 2 product, 1 backends, 0 kernels (the package root counts as product)."""
    if name.startswith("bertfast.tools") or name == "bertfast.__main__":
        return 3
    if name.startswith("bertfast.backends"):
        return 1
    if name.startswith("bertfast.kernels") or name == "bertfast._C":
        return 0
    return 2


def test_graph_is_read():
    assert "bertfast.engine" in GRAPH and "bertfast.backends" in GRAPH["bertfast.engine"]
    assert "bertfast.backends.cpu.isa" in GRAPH["bertfast.backends"]
    assert "bertfast.backends.cuda.graphs" in GRAPH["bertfast.engine"]


def test_contract_imports_no_backend():
    """The contract every backend implements depends on none of them: a backend's own rules (`precision`) live in it."""
    backends = {n for n in MODULES if n.startswith(("bertfast.backends.cpu", "bertfast.backends.cuda"))}
    backends.add("bertfast.backends.torch")
    assert not GRAPH["bertfast.backends.contract"] & backends, GRAPH["bertfast.backends.contract"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    """A module imports its own floor or below; the oracle is imported by the torch backend only."""
    for target in GRAPH[name]:
        if target == "bertfast.reference":
            assert name in ("bertfast.backends.torch",) or _floor(name) == 3, (
                f"{name} imports the oracle bertfast.reference")
        elif target != "bertfast":  # `from bertfast import __version__` style reads of the root
            assert _floor(target) <= _floor(name), f"{name} (floor {_floor(name)}) imports {target} above it"


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if nxt == "bertfast" or nxt not in GRAPH:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_is_readable_in_one_sitting(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (split it along a seam, house style ~{MAX_LINES})"


TESTS = pathlib.Path(__file__).resolve().parent


def _dotted(path: pathlib.Path) -> str:
    """The name a module under tests/ imports as (the tests directory is on sys.path): test_x, ops.test_y."""
    return ".".join(path.relative_to(TESTS).with_suffix("").parts)


def _imported_names(path: pathlib.Path) -> set[str]:
    """Every dotted name `path` imports, function-local imports included; `from a import b` gives a and a.b."""
    package = _dotted(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".") if package else []
            base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]) if node.level else node.module
            base = base.strip(".")
            names.add(base)
            names.update(f"{base}.{a.name}".strip(".") for a in node.names)
    return names


def test_no_test_module_imports_another():
    """Each test module runs, changes or goes alone: shared builders and checks live in non-test modules."""
    files = sorted(TESTS.rglob("*.py"))
    test_modules = {_dotted(p) for p in files if p.name.startswith("test_") or p.stem.endswith("_test")}
    assert "test_layout" in test_modules and "ops.triton.test_attention" in test_modules  # the walk found them
    found = [f"{_dotted(p)} imports {name}" for p in files for name in sorted(_imported_names(p) & test_modules)]
    assert not found, ("modules under tests/ import test modules (move what they share to tests/helpers/): "
                       + "; ".join(found))
