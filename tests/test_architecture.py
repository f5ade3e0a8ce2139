"""The package's shape, read from its source with ``ast``: imports go only the directions the
docs' Architecture page draws, with no circle (imports made only for type checking count: a
reader follows them too); no class over 250 lines, no module over 400. A long class or
module is a sign of several jobs in one place."""

from __future__ import annotations

import ast
import inspect
import re
import types
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.unit
def test_no_import_circle():
    assert cycles(import_graph()) == []


@pytest.mark.unit
def test_the_graph_sees_type_checking_and_relative_imports():
    graph = import_graph()
    assert "elastic_magic.wire.messages" in graph["elastic_magic.agent.machines.roles"]
    assert "elastic_magic.agent.round_info" in graph["elastic_magic.agent.loop.cells"]  # typing
    assert "elastic_magic" not in graph["elastic_magic.agent.node.interpreter"]  # its package
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.unit
def test_no_class_over_250_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (lines := node.end_lineno - first + 1) > MAX_CLASS_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


@pytest.mark.unit
def test_no_module_over_400_lines():
    long = [f"{name}: {count} lines" for name, path in _modules().items()
            if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []


@pytest.mark.unit
def test_every_class_says_what_it_is():
    # private and nested classes too: a newcomer reads those first when a name says little
    silent = [f"{name}.{node.name} (line {node.lineno})" for name, path in _modules().items()
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) and not ast.get_docstring(node)]
    assert silent == []


# agent/'s subpackages, from the top: each imports only those below it, and agent/'s own
# modules (the vocabulary: inbox, policy, status, round_info). machines and diagnosis are peers.
AGENT_LAYERS = {
    "handles": {"loop", "machines", "diagnosis", "node"},
    "loop": {"machines", "diagnosis", "node"},
    "machines": {"node"},
    "diagnosis": {"node"},
    "node": set(),
}
# The package's top-level parts, by what may import them. The notebook side (the magics,
# sessions, launch() and the dashboard) is imported by no other: the agent, the workers and
# a joining machine run where there is no IPython. The workers and the training API inside
# them never reach the kernel's agent or the launchers. The vocabulary (the wire and the
# job's terms) is used by every side and uses none.
NOTEBOOK = {"notebook", "ui"}
RANK_SIDE = {"worker", "training", "integrations"}
VOCABULARY = {"wire", "spec", "checks", "result", "result_parts", "stacks", "logs", "folders",
              "torch_internals"}
SIDES = {"agent", "launchers", "cli", *NOTEBOOK, *RANK_SIDE}
NOTEBOOK_LIBRARIES = {"IPython", "ipywidgets", "anywidget", "ipykernel", "traitlets"}
# The one import against these rules: the warm pool's zygote imports the training API to
# preload it (it runs none of it).
PRELOADS = {("elastic_magic.worker.zygote", "elastic_magic.training.state")}


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
    if (module, other) in PRELOADS or top == other_top == "":
        return True
    if top == "agent" and other_top == "agent" and other_sub not in (None, sub):
        return sub is not None and other_sub in AGENT_LAYERS[sub]
    if other_top in NOTEBOOK:  # the notebook side, the package's root, and cli's text output
        return top in (*NOTEBOOK, "") or (top == "cli" and other == "elastic_magic.ui.text")
    if top in RANK_SIDE:
        return other_top not in ("agent", "launchers", "cli")
    if top in VOCABULARY:
        return other_top not in SIDES or (module, other_top) == ("elastic_magic.spec",
                                                                 "launchers")
    return True


def against_the_layers(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {other}" for module, imports in graph.items()
                  for other in imports if not _allowed(module, other))


def test_imports_go_only_the_directions_the_layout_draws():
    graph = import_graph()
    assert {sub for name in graph if (sub := _part(name)[1])} == set(AGENT_LAYERS)
    # every top-level module or package has its place in the rules
    assert {_part(name)[0] for name in graph} == {"", *SIDES, *VOCABULARY}
    assert against_the_layers(graph) == []
    libraries = []
    for name, path in _modules().items():
        if _part(name)[0] in NOTEBOOK or name == "elastic_magic":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            libraries += [f"{name} -> {f}" for f in found
                          if f.partition(".")[0] in NOTEBOOK_LIBRARIES]
    assert libraries == []


@pytest.mark.unit
def test_the_layer_rule_sees_each_kind_of_wrong_import():
    agent, em = "elastic_magic.agent", "elastic_magic"
    assert against_the_layers({
        f"{agent}.node.workers": {f"{agent}.loop.engine", f"{agent}.inbox"},
        f"{agent}.machines.roles": {f"{agent}.diagnosis.hangs", f"{agent}.node.group"},
        f"{agent}.inbox": {f"{agent}.handles.job"},
        f"{em}.worker.runner": {f"{agent}.node.pool", f"{em}.ui.text", f"{em}.training.state"},
        f"{em}.training.state": {f"{em}.launchers.slurm", f"{em}.worker.client"},
        f"{em}.wire.messages": {f"{em}.notebook.session", f"{em}.training.rng"},
        f"{em}.spec": {f"{em}.launchers", f"{em}.agent.handles.job"},
        f"{em}.cli": {f"{em}.ui.text", f"{em}.ui.dashboard"},
        f"{agent}.loop.engine": {f"{agent}.machines.roles", f"{agent}.loop.inbox"},
    }) == [f"{agent}.inbox -> {agent}.handles.job",
           f"{agent}.machines.roles -> {agent}.diagnosis.hangs",
           f"{agent}.node.workers -> {agent}.loop.engine",
           f"{em}.cli -> {em}.ui.dashboard",
           f"{em}.spec -> {agent}.handles.job",
           f"{em}.training.state -> {em}.launchers.slurm",
           f"{em}.wire.messages -> {em}.notebook.session",
           f"{em}.wire.messages -> {em}.training.rng",
           f"{em}.worker.runner -> {agent}.node.pool",
           f"{em}.worker.runner -> {em}.ui.text"]


def test_modules_moved_by_the_regrouping_are_found_under_their_old_names():
    """``elastic_magic.state`` and the other modules users may have imported before the
    package was regrouped are the modules at their new places, not copies."""
    import importlib

    import elastic_magic
    from elastic_magic import _MOVED

    for old, new in _MOVED.items():
        moved = importlib.import_module(f"elastic_magic.{old}")
        assert moved is importlib.import_module(f"elastic_magic.{new}")
    assert elastic_magic.state.State is elastic_magic.State  # type: ignore[attr-defined]


def test_every_public_name_resolves():
    """The package imports its public names on first use (a worker does not pay for the
    agent): each must still be found where ``__init__`` says it is."""
    import elastic_magic

    assert [name for name in elastic_magic.__all__
            if getattr(elastic_magic, name, None) is None] == []


# -- the public API's docstrings: the reference pages are made of them --------------------

# What a third party implements and registers under the ``elastic_magic.launchers`` entry point.
LAUNCHER_INTERFACE = ("Launcher", "JoinRequest", "Allocation", "LauncherError")
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(\([^)]*\))?:")


def public_api() -> dict[str, Any]:
    """Dotted name -> object: the names of ``elastic_magic.__all__`` and the launcher
    interface, with the public methods and properties of their classes that elastic_magic
    writes (inherited ones too; not those of torch's DataLoader or of ``str``)."""
    import elastic_magic
    from elastic_magic import launchers

    roots = {f"elastic_magic.{name}": getattr(elastic_magic, name)
             for name in elastic_magic.__all__}
    roots |= {f"elastic_magic.launchers.{name}": getattr(launchers, name)
              for name in LAUNCHER_INTERFACE}
    found = dict(roots)
    for qualified, obj in roots.items():
        if not inspect.isclass(obj):
            continue
        for owner in reversed(obj.__mro__):  # a subclass's own method wins
            if owner.__module__.partition(".")[0] != "elastic_magic":
                continue
            for name, member in vars(owner).items():
                if not name.startswith("_") and isinstance(
                        member, types.FunctionType | staticmethod | classmethod | property):
                    found[f"{qualified}.{name}"] = member
    return found


def _sections(doc: str) -> dict[str, set[str]]:
    """A Google-style docstring's sections (``Args:``, ``Returns:``...) -> the names its
    entries document (``name (type): text`` or ``name: text``, ``*args``, ``**kwargs``)."""
    sections: dict[str, set[str]] = {}
    current: set[str] | None = None
    indent: int | None = None
    for line in doc.splitlines():
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:
            header = re.fullmatch(r"([A-Z]\w*):", line.strip())
            current = sections.setdefault(header.group(1), set()) if header else None
            indent = None
        elif current is not None:
            indent = depth if indent is None else indent
            if depth == indent and (entry := _ENTRY.match(line.strip())):
                current.add(entry.group(1))
    return sections


def _constructor(cls: type) -> Any:
    """The ``__init__`` a class runs, if elastic_magic wrote (or generated) it."""
    init = next(vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c))
    module = getattr(init, "__module__", None) or ""
    return init if module.partition(".")[0] == "elastic_magic" else None


def undocumented(qualified: str, obj: Any) -> list[str]:
    """What ``obj``'s docstring lacks: itself; its parameters under ``Args:`` (a class's
    constructor: under ``Args:`` or, for fields, ``Attributes:``); ``Returns:`` if it
    returns something. A property is documented as an attribute: its docstring alone."""
    doc = obj.__doc__  # its own: inspect.getdoc would lend it an overridden method's
    if not doc or not doc.strip():
        return [f"{qualified}: no docstring"]
    if isinstance(obj, property):
        return []
    sections = _sections(inspect.cleandoc(doc))
    function = obj.__func__ if isinstance(obj, staticmethod | classmethod) else obj
    if inspect.isclass(obj):
        function = _constructor(obj)
        if function is None:
            return []
    signature = inspect.signature(function)
    documented = sections.get("Args", set()) | (
        sections.get("Attributes", set()) if inspect.isclass(obj) else set())
    problems = [f"{qualified}: {name} not under Args:" for name in signature.parameters
                if name not in ("self", "cls") and name not in documented]
    returned = signature.return_annotation
    if not inspect.isclass(obj) and returned not in (None, "None", inspect.Signature.empty) \
            and "Returns" not in sections:
        problems.append(f"{qualified}: no Returns:")
    return problems


@pytest.mark.unit
def test_the_public_api_is_documented():
    api = public_api()
    # the walk reaches methods, inherited ones and properties
    assert {"elastic_magic.State.commit", "elastic_magic.Job.log_dir",
            "elastic_magic.Session.run", "elastic_magic.launchers.Launcher.start",
            "elastic_magic.JobSpec.create"} <= set(api)
    assert "elastic_magic.DataLoader.check_worker_number_rationality" not in api  # torch's
    problems = {name: undocumented(name, obj) for name, obj in sorted(api.items())}
    assert [problem for found in problems.values() for problem in found] == []


@pytest.mark.unit
def test_the_docstring_check_sees_what_is_missing():
    def good(a: int, *rest: int, **options: Any) -> int:
        """Add.

        Args:
            a (int): One.
            *rest: More.
            **options: Ignored.

        Returns:
            The sum.
        """
        return a

    def bad(a: int, b: int) -> int:
        """Add.

        Args:
            a: One.
                b: not an entry (a continuation line).
        """
        return a

    class Point:
        """A point.

        Attributes:
            x: Across.
        """

        def __init__(self, x: int, y: int) -> None:
            self.x, self.y = x, y

    Point.__init__.__module__ = "elastic_magic.fake"  # as though elastic_magic wrote it
    assert undocumented("good", good) == []
    assert undocumented("bad", bad) == ["bad: b not under Args:", "bad: no Returns:"]
    assert undocumented("Point", Point) == ["Point: y not under Args:"]
    assert undocumented("none", lambda: None) == ["none: no docstring"]
