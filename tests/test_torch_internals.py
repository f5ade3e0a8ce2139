"""torch's private names: all of them reached from ``elastic_magic/torch_internals/`` only,
each checked against the installed torch, and a torch that lacks one refused by name."""

from __future__ import annotations

import ast
import contextlib
import dis
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from elastic_magic import torch_internals as ti

pytestmark = pytest.mark.unit


def test_every_private_name_elastic_magic_relies_on_is_there_in_the_installed_torch():
    ti.check_all()
    for need in ti.NEEDS:  # the objects the adapters use, found where the needs say
        assert ti.check(need) is not None, need.where


def test_the_checks_see_torchs_own_functions_through_the_poll_hooks_installed():
    from elastic_magic.agent.machines import quick_rounds

    assert dynamic_rendezvous._delay is quick_rounds._delay
    assert ti.check(ti.DELAY) is quick_rounds._delay  # the signature seen is torch's
    assert ti.check(ti.OPERATION_RUN) is quick_rounds._run
    assert ti.pace_rendezvous_polls(quick_rounds._delay, quick_rounds._run) == (
        quick_rounds._torch_delay, quick_rounds._torch_run)
    with pytest.raises(RuntimeError, match="already paced"):
        ti.pace_rendezvous_polls(lambda seconds: None, quick_rounds._run)


def _refusal(need: ti.Need) -> str:
    with pytest.raises(ti.UnsupportedTorch) as refused:
        ti.check(need)
    message = str(refused.value)
    assert f"torch {torch.__version__} is not supported by elastic_magic" in message
    assert need.where in message
    assert f"pip install 'torch{ti.SUPPORTED_TORCH}'" in message
    return message


def test_a_torch_without_a_name_is_refused_naming_the_version_the_name_and_the_fix(
        monkeypatch):
    monkeypatch.delattr(dynamic_rendezvous, "_remove_participant_epilogue")
    assert "does not exist in this torch" in _refusal(ti.REMOVE_EPILOGUE)
    monkeypatch.delattr(dynamic_rendezvous.DynamicRendezvousHandler,
                        "_create_tcp_store_server")
    assert "does not exist" in _refusal(ti.CREATE_STORE)
    assert "no longer uses _create_tcp_store_server" not in _refusal(ti.CREATE_STORE)


def test_a_changed_signature_or_a_method_that_stopped_using_a_name_is_refused(monkeypatch):
    monkeypatch.setattr(dynamic_rendezvous, "_remove_participant_epilogue",
                        lambda state, settings, extra: None)
    assert "takes (state, settings, extra) here, where elastic_magic expects " \
           "(state, settings)" in _refusal(ti.REMOVE_EPILOGUE)

    def next_rendezvous(self):  # a torch that no longer hosts the store through the hook
        return self._bootstrap_store_info, self._shared_tcp_store_server

    monkeypatch.setattr(dynamic_rendezvous.DynamicRendezvousHandler, "next_rendezvous",
                        next_rendezvous)
    assert "no longer uses _create_tcp_store_server" in _refusal(ti.NEXT_ROUND)
    monkeypatch.delattr(dynamic_rendezvous._NodeDesc, "__annotations__")
    assert "no longer uses addr, pid" in _refusal(ti.NODE)


def test_an_adapter_checks_its_names_before_it_reaches_in(monkeypatch):
    monkeypatch.setattr(ti, "_checked", {})
    monkeypatch.delattr(dynamic_rendezvous, "_remove_participant_epilogue")
    handler = SimpleNamespace()  # never reached: the check refuses first
    with pytest.raises(ti.UnsupportedTorch, match="_remove_participant_epilogue"):
        ti.remove_rendezvous_node(handler, "10.0.0.1", 1)  # type: ignore[arg-type]
    monkeypatch.delattr(sys.modules["torch.library"], "_del_library")
    with pytest.raises(ti.UnsupportedTorch, match=re.escape("torch.library._del_library")):
        ti.is_library_cleanup(print)


def test_the_declared_torch_range_is_the_one_the_checks_name_and_ci_tests_its_version():
    root = Path(__file__).resolve().parent.parent
    pyproject = (root / "pyproject.toml").read_text()
    assert f'"torch{ti.SUPPORTED_TORCH}"' in pyproject
    assert f"torch=={ti.TESTED_TORCH}" in (root / "constraints" / "ci.txt").read_text()
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    assert Version(ti.TESTED_TORCH) in SpecifierSet(ti.SUPPORTED_TORCH)
    assert Version(torch.__version__.split("+")[0]) in SpecifierSet(ti.SUPPORTED_TORCH)


# Nothing else touches torch's private names ---------------------------------------------
#
# What counts as a touch, found in the source (ast) without running it:
# 1. an import of a private torch module or of a private name from torch
#    (``import torch._dynamo``, ``from torch.x import _y``);
# 2. ``._x`` (one leading underscore or a mangled ``__x``, not a dunder) on an expression
#    rooted at a torch name: a name imported from torch, a class derived from a torch class,
#    a name assigned from such an expression, a parameter, variable or ``self.attr``
#    annotated with such a type, or a call to a function annotated to return one;
# 3. in a class derived from a torch class: defining, or reaching on ``self``, ``cls`` or
#    ``super()``, a private name the torch base has (a member, or an attribute its methods
#    set); the class's own private names are its own;
# 4. ``getattr``/``setattr``/``hasattr``/``delattr`` on a torch name with a private name.

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_torch(module: str | None) -> bool:
    return module == "torch" or (module or "").startswith("torch.")


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _rooted(node: ast.AST, bound: set[str]) -> bool:
    """Whether ``node`` is, or hangs off (attributes, calls, subscripts), a torch name."""
    while True:
        dotted = _dotted(node)
        if dotted is not None and dotted in bound:
            return True
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            return False


def _mentions(annotation: ast.AST | None, bound: set[str]) -> bool:
    """Whether a type annotation names a torch type (``X | None``, ``Optional[X]``, "X")."""
    if annotation is None:
        return False
    for node in ast.walk(annotation):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            with contextlib.suppress(SyntaxError):
                if _mentions(ast.parse(node.value, mode="eval"), bound):
                    return True
        elif isinstance(node, ast.Name | ast.Attribute) and _dotted(node) in bound:
            return True
    return False


def _targets(target: ast.AST) -> set[str]:
    """The names (``x``, ``self.x``) an assignment target binds."""
    if isinstance(target, ast.Tuple | ast.List):
        return set().union(*(_targets(element) for element in target.elts))
    if isinstance(target, ast.Starred):
        return _targets(target.value)
    dotted = _dotted(target)
    return {dotted} if dotted else set()


def _torch_names_of(base: Any) -> set[str] | None:
    """The private names a torch class has: members, and attributes its methods set."""
    if not isinstance(base, type):
        return None
    names = {name for name in dir(base) if _private(name)}
    for klass in base.__mro__:
        if not _from_torch(klass.__module__):
            continue
        for value in vars(klass).values():
            function = getattr(value, "fget", None) or getattr(value, "__func__", value)
            code = getattr(inspect.unwrap(function), "__code__", None) \
                if callable(function) else None
            if code is not None:
                names |= {ins.argval for ins in dis.get_instructions(code)
                          if ins.opname == "STORE_ATTR" and _private(ins.argval)}
    return names


def touches(source: str, where: str) -> list[str]:
    """Every touch of a private torch name in ``source`` (see the rules above)."""
    tree = ast.parse(source)
    imports: dict[str, tuple[str, str | None]] = {}  # bound name -> (module, name in it)
    bound: set[str] = set()
    derived: dict[str, ast.ClassDef] = {}
    found: list[tuple[int, str]] = []

    def touch(node: ast.AST) -> None:
        found.append((node.lineno, ast.unparse(node).splitlines()[0][:90]))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _from_torch(alias.name):
                    if any(_private(part) for part in alias.name.split(".")):
                        touch(node)
                    name = alias.asname or alias.name.split(".")[0]
                    imports[name] = (alias.name if alias.asname else name, None)
                    bound.add(name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _from_torch(node.module):
            module = node.module or ""
            if any(_private(part) for part in module.split(".")) or any(
                    _private(alias.name) for alias in node.names):
                touch(node)
            for alias in node.names:
                imports[alias.asname or alias.name] = (module, alias.name)
                bound.add(alias.asname or alias.name)

    size = -1
    while size != len(bound):  # names bound to torch things, until nothing more is found
        size = len(bound)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(_rooted(b, bound) for b in node.bases):
                derived[node.name] = node
                bound.add(node.name)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _mentions(node.returns, bound):
                    bound |= {node.name, f"self.{node.name}", f"cls.{node.name}"}
                args = node.args
                for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                    if _mentions(arg.annotation, bound):
                        bound.add(arg.arg)
            elif isinstance(node, ast.AnnAssign):
                target = _dotted(node.target)
                if target and (_mentions(node.annotation, bound) or (
                        node.value is not None and _rooted(node.value, bound))):
                    bound.add(target)
            elif isinstance(node, ast.Assign | ast.NamedExpr | ast.For | ast.withitem):
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, ast.NamedExpr):
                    pairs = [(node.target, node.value)]
                elif isinstance(node, ast.For):
                    pairs = [(node.target, node.iter)]
                else:
                    pairs = [(node.optional_vars, node.context_expr)] \
                        if node.optional_vars else []
                for target, value in pairs:
                    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                            and len(target.elts) == len(value.elts):
                        pairs += list(zip(target.elts, value.elts, strict=True))
                    elif _rooted(value, bound):
                        bound |= _targets(target)

    for node in ast.walk(tree):
        reached = isinstance(node, ast.Attribute) and _private(node.attr) \
            and _rooted(node.value, bound)
        by_name = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
            and len(node.args) >= 2 and _rooted(node.args[0], bound) \
            and isinstance(node.args[1], ast.Constant) and _private(str(node.args[1].value))
        if reached or by_name:
            touch(node)

    def base_names(base: ast.AST) -> set[str] | None:
        while isinstance(base, ast.Subscript):  # Dataset[Any]
            base = base.value
        dotted = _dotted(base) or ""
        root, *rest = dotted.split(".")
        if root in derived:
            return class_names(derived[root])
        if root not in imports:
            return set()  # not a torch class
        module, name = imports[root]
        try:
            found_: Any = importlib.import_module(module)
            if name is not None:
                found_ = getattr(found_, name, None) or importlib.import_module(
                    f"{module}.{name}")
            for part in rest:
                found_ = getattr(found_, part)
        except (ImportError, AttributeError):
            return None
        return _torch_names_of(found_)

    def class_names(cls: ast.ClassDef) -> set[str] | None:
        names: set[str] | None = set()
        for base in cls.bases:
            more = base_names(base)
            names = None if names is None or more is None else names | more
        return names

    for cls in derived.values():
        torch_names = class_names(cls)  # None: unknown, so every private name is torch's

        def torchs(name: str) -> bool:
            return _private(name) and (torch_names is None or name in torch_names)  # noqa: B023

        for node in ast.walk(cls):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and torchs(node.name):
                found.append((node.lineno, f"{cls.name}.{node.name} overrides torch's"))
            elif isinstance(node, ast.Attribute) and torchs(node.attr) and (
                    (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    or (isinstance(node.value, ast.Call)
                        and _dotted(node.value.func) == "super")):
                touch(node)
    return [f"{where}:{line}: {what}" for line, what in sorted(set(found))]


_H = "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import " \
     "DynamicRendezvousHandler as H\n"


@pytest.mark.parametrize(("source", "count"), [
    ("from torch.distributed.elastic.rendezvous.dynamic_rendezvous import "
     "_remove_participant_epilogue", 1),
    ("import torch._dynamo", 1),
    ("from torch._C import _distributed_c10d", 1),
    ("import torch.distributed as dist\ndist.distributed_c10d._world.pg_map", 1),
    ("from torch.utils import data\nx = data.dataloader._BaseDataLoaderIter", 1),
    ("import torch\ntorch.cuda._lazy_init()", 1),
    ("from torch.distributed import TCPStore\ndef f(store: TCPStore | None):\n"
     "    return store._underlying", 1),
    ("from torch.distributed import TCPStore\ns = TCPStore('h', 1)\nt = s\nt._x", 1),
    ("from torch.distributed import TCPStore\nclass A:\n    def __init__(self):\n"
     "        self.store: TCPStore = make()\n    def f(self):\n        return self.store._impl",
     1),
    (_H + "class M(H):\n    def _create_tcp_store_server(self, a, p):\n"
     "        self._bootstrap_store_info = None\n        self._mine = 1", 2),
    (_H + "class M(H):\n    pass\nclass N(M):\n    def f(self):\n"
     "        super()._stop_heartbeats()", 1),
    (_H + "def make() -> H: ...\nclass R:\n    def f(self):\n        other = make()\n"
     "        holder, n = other._state_holder, 1", 1),
    (_H + "class R:\n    def _new(self) -> 'H': ...\n    def f(self):\n"
     "        return self._new()._state_holder", 1),
    ("import torch\ngetattr(torch.library, '_del_library')", 1),
    ("import os, sys\nos._exit(0)\nsys._getframe(1)\ncomm._reply_subshell_id", 0),
    ("class A:\n    def _mine(self):\n        return self._x", 0),
    ("import torch.utils.data as tud\nclass L(tud.DataLoader):\n    def __init__(self):\n"
     "        self._seeds = True\n    def _helper(self):\n        return self._seeds", 0),
    ("import torch\nx = torch.__version__\ny = torch.Tensor.__name__", 0),
])
def test_what_counts_as_touching_a_private_torch_name(source, count):
    assert len(touches(source, "snippet")) == count, touches(source, "snippet")


def test_no_module_but_torch_internals_touches_a_private_torch_name():
    here = Path(ti.__file__).resolve().parent  # the torch_internals package
    package = here.parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if here not in path.parents:
            found += touches(path.read_text(), str(path.relative_to(package.parent)))
    assert not found, (
        "torch's private names reached outside elastic_magic/torch_internals/ (make each "
        "a function there, with a Need that checks it):\n" + "\n".join(found))
