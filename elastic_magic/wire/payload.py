"""What a worker runs: the cell's source (or a function) and the kernel globals it uses.

Globals are serialized one by one with cloudpickle, so a value that cannot cross a process
boundary is named, with the reason, before any worker starts. Functions and classes defined
in the notebook live in ``__main__`` and travel by value; modules travel by name and are
imported again in the worker.
"""

from __future__ import annotations

import ast
import builtins
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from ..stacks import CELL_FILENAME

if TYPE_CHECKING:
    from ..spec import JobSpec


# Names IPython keeps in the user namespace that no cell means to ship.
_IPYTHON_NAMES = frozenset(
    {"In", "Out", "_", "__", "___", "_oh", "_ih", "_dh", "get_ipython", "exit", "quit"}
)


class PayloadError(ValueError):
    """The cell or one of its globals cannot be sent to the workers."""


@dataclass
class Payload:
    """One unit of work for every worker of a job."""

    source: str | None = None
    function: bytes | None = None  # cloudpickled (fn, args, kwargs)
    globals: dict[str, bytes] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # name in namespace -> module
    argv: list[str] = field(default_factory=lambda: [CELL_FILENAME])
    cwd: str = field(default_factory=os.getcwd)
    sys_path: list[str] = field(default_factory=lambda: list(sys.path))
    pull: list[str] = field(default_factory=list)
    init_process_group: bool = True
    backend: str = "gloo"
    timeout: float = 300.0
    # A session's cell: it runs in the rank's persistent namespace, and a failure is
    # reported without ending the worker (worker/session_cells.py).
    session: bool = False
    # A setup cell replayed on a new rank while the survivors wait: collectives refuse
    # (worker/replay_alone.py).
    replayed_alone: bool = False


def build_payload(
    target: Callable[..., Any] | str, spec: JobSpec, *, args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None, namespace: dict[str, Any] | None = None,
) -> Payload:
    """The payload for ``spec``: a cell's source (with the globals it reads from
    ``namespace``) or a function called as ``target(*args, **kwargs)`` on every rank."""
    settings: dict[str, Any] = dict(
        argv=[CELL_FILENAME, *spec.argv], pull=spec.pull, backend=spec.backend,
        timeout=spec.timeout, init_process_group=spec.init_process_group, cwd=os.getcwd(),
    )
    if isinstance(target, str):
        return cell_payload(target, namespace or {}, **settings)
    return function_payload(target, args, kwargs or {}, **settings)


def referenced_names(source: str) -> set[str]:
    """Names the code reads anywhere (module level or inside its functions)."""
    try:
        tree = ast.parse(source, filename=CELL_FILENAME)
    except SyntaxError as exc:
        raise PayloadError(_syntax_message(exc)) from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _syntax_message(exc: SyntaxError) -> str:
    where = f"cell line {exc.lineno}" if exc.lineno else "the cell"
    line = f": {exc.text.strip()}" if exc.text else ""
    return f"SyntaxError at {where}{line}: {exc.msg}. Fix the cell; nothing was started."


def uses_ipython_syntax(source: str) -> bool:
    """True when IPython's transformer turned magics or ``!`` escapes into get_ipython()."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False  # reported, with its line, when the payload is built
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "get_ipython"
        for node in ast.walk(tree)
    )


def capture_globals(
    names: set[str], namespace: dict[str, Any]
) -> tuple[dict[str, bytes], dict[str, str]]:
    """Serialize the namespace entries among ``names``; modules are shipped by name."""
    values: dict[str, bytes] = {}
    modules: dict[str, str] = {}
    problems: list[str] = []
    for name in sorted(names):
        if name not in namespace or name in _IPYTHON_NAMES or name.startswith("_i"):
            continue
        value = namespace[name]
        if value is getattr(builtins, name, object()):
            continue
        if isinstance(value, types.ModuleType):
            if value.__spec__ is None:
                problems.append(f"  {name}: module {value.__name__!r} cannot be imported by name")
            else:
                modules[name] = value.__name__
            continue
        try:
            values[name] = cloudpickle.dumps(value)
        except Exception as exc:  # any pickling failure: name the variable and why
            problems.append(f"  {name} ({type(value).__name__}): {type(exc).__name__}: {exc}")
    if problems:
        raise PayloadError(
            "These kernel variables are used by the cell but cannot be sent to the workers:\n"
            + "\n".join(problems)
            + "\nCreate them inside the cell instead (or pass something picklable); "
            "nothing was started."
        )
    return values, modules


def cell_payload(source: str, namespace: dict[str, Any], **settings: Any) -> Payload:
    """A payload that runs ``source`` as ``__main__`` with the globals it references."""
    if not source.strip():
        raise PayloadError("The cell is empty: write the code for the workers below the magic.")
    names = referenced_names(source)
    values, modules = capture_globals(names, namespace)
    return Payload(source=source, globals=values, modules=modules, **settings)


def step_payload(start: Payload, fn: Callable[..., Any], *args: Any,
                 make_group: bool = False) -> Payload:
    """A session's own step, not a cell: ``fn(*args)`` on the ranks, in the folder and path
    of the session's start payload; ``make_group``: with its process group (the job's
    backend and timeout) made where ``fn`` first uses it."""
    return function_payload(fn, args, {}, session=True, init_process_group=make_group,
                            backend=start.backend, timeout=start.timeout, cwd=start.cwd,
                            sys_path=start.sys_path)


def function_payload(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **settings: Any
) -> Payload:
    """A payload that calls ``fn(*args, **kwargs)`` on every rank."""
    if not callable(fn):
        raise PayloadError(f"launch() needs a function or source code, got {type(fn).__name__}.")
    try:
        blob = cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise PayloadError(
            f"{getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the workers: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    return Payload(function=blob, **settings)
