"""The package's shape, read from its source with ``ast``: imports go only the directions the
README's Layout section draws, with no circle (imports made only for type checking count: a
reader follows them too); no class over 250 lines, no module over 400. A long class or
module is a sign of several jobs in one place."""

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
    assert "elastic_magic.messages" in graph["elastic_magic.agent.machines.roles"]
    assert "elastic_magic.agent.rounds" in graph["elastic_magic.agent.loop.cells"]  # typing
    assert "elastic_magic" not in graph["elastic_magic.agent.local.interpreter"]  # its package
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


# agent/'s subpackages, from the top: each imports only those below it, and agent/'s own
# modules (the vocabulary: inbox, policy, status, rounds). machines and diagnosis are peers.
AGENT_LAYERS = {
    "handles": {"loop", "machines", "diagnosis", "local"},
    "loop": {"machines", "diagnosis", "local"},
    "machines": {"local"},
    "diagnosis": {"local"},
    "local": set(),
}
# What runs in the notebook's frontend side of the kernel: never imported by the agent or the
# workers, which must run where there is no IPython (a joining machine, a worker process).
NOTEBOOK = {"magics", "magic_common", "session_magic", "job_commands", "comm", "ui", "session",
            "api"}
NOTEBOOK_LIBRARIES = {"IPython", "ipywidgets", "anywidget", "ipykernel", "traitlets"}
# The package's vocabulary: every side uses it, it uses no side.
VOCABULARY = {"messages", "protocol", "events", "result", "spec", "checks", "payload",
              "stacks", "logs", "folders", "snapshot_format", "torch_internals", "rng"}


def _part(module: str) -> tuple[str, str | None]:
    """(top-level part, agent subpackage or None): elastic_magic.agent.loop.engine ->
    ("agent", "loop"); elastic_magic.agent.inbox -> ("agent", None)."""
    parts = module.split(".")[1:]
    if not parts:
        return "", None
    sub = parts[1] if parts[0] == "agent" and len(parts) > 2 else None
    return parts[0], sub


def _allowed(module: str, other: str) -> bool:
    top, sub = _part(module)
    other_top, other_sub = _part(other)
    if top == "agent" and other_top == "agent" and other_sub not in (None, sub):
        return sub is not None and other_sub in AGENT_LAYERS[sub]
    if top in ("agent", "worker") and other_top in NOTEBOOK:
        return False
    if top == "worker" and other_top == "agent":
        return False
    return not (top in VOCABULARY and other_top in ("agent", "worker", *NOTEBOOK))


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {other}" for module, imports in graph.items()
                  for other in imports if not _allowed(module, other))


def test_imports_go_only_the_directions_the_layout_draws():
    graph = import_graph()
    assert {sub for name in graph if (sub := _part(name)[1])} == set(AGENT_LAYERS)
    assert against_the_layers(graph) == []
    libraries = []
    for name, path in _modules().items():
        if _part(name)[0] not in ("agent", "worker"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            libraries += [f"{name} -> {f}" for f in found
                          if f.partition(".")[0] in NOTEBOOK_LIBRARIES]
    assert libraries == []


def test_the_layer_rule_sees_each_kind_of_wrong_import():
    agent = "elastic_magic.agent"
    assert against_the_layers({
        f"{agent}.local.workers": {f"{agent}.loop.engine", f"{agent}.inbox"},
        f"{agent}.machines.roles": {f"{agent}.diagnosis.hangs", f"{agent}.local.group"},
        f"{agent}.inbox": {f"{agent}.handles.job"},
        "elastic_magic.worker.runner": {f"{agent}.local.pool", "elastic_magic.ui.text"},
        "elastic_magic.messages": {"elastic_magic.session"},
        f"{agent}.loop.engine": {f"{agent}.machines.roles", f"{agent}.loop.inbox"},
    }) == [f"{agent}.inbox -> {agent}.handles.job",
           f"{agent}.local.workers -> {agent}.loop.engine",
           f"{agent}.machines.roles -> {agent}.diagnosis.hangs",
           "elastic_magic.messages -> elastic_magic.session",
           f"elastic_magic.worker.runner -> {agent}.local.pool",
           "elastic_magic.worker.runner -> elastic_magic.ui.text"]


def test_every_public_name_resolves():
    """The package imports its public names on first use (a worker does not pay for the
    agent): each must still be found where ``__init__`` says it is."""
    import elastic_magic

    assert [name for name in elastic_magic.__all__
            if getattr(elastic_magic, name, None) is None] == []
