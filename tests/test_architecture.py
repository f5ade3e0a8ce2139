"""The package's shape, read from its source with ``ast``: no import circle (imports made only
for type checking count: a reader follows them too), no class over 250 lines, no module over
400. A long class or module is a sign of several jobs in one place."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "elastic_magic"
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
              known: set[str]) -> set[str]:
    """The package's modules that ``node`` (in ``module``) imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        prefix = (f"{base}.{node.module}" if node.module else base) if node.level \
            else node.module or ""
        # ``from .x import y``: y may be a module of its own (then that is the import)
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix
                 for alias in node.names]
    return {name for name in names if name in known}


def import_graph() -> dict[str, set[str]]:
    """Every import of the package's modules, wherever it is written (at the top, under
    TYPE_CHECKING, inside a function), but of the importing module's own packages."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(node, name, path.name == "__init__.py", known)
        # A module's own packages are imported before it whatever it writes (``import
        # elastic_magic`` to find its folder, say): naming one adds no edge.
        ancestors = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        graph[name] = edges - {name} - ancestors
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_the_graph_sees_type_checking_and_relative_imports():
    graph = import_graph()
    assert "elastic_magic.messages" in graph["elastic_magic.agent.roles"]
    assert "elastic_magic.agent.rendezvous" in graph["elastic_magic.agent.cells"]  # typing
    assert "elastic_magic" not in graph["elastic_magic.agent.interpreter"]  # its package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_class_over_250_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (lines := node.end_lineno - first + 1) > MAX_CLASS_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


def test_no_module_over_400_lines():
    long = [f"{name}: {count} lines" for name, path in _modules().items()
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []
