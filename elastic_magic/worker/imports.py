"""What a pooled worker imported beyond its zygote, and what the zygote may import.

The warm pool learns which modules a kernel's cells import: a worker
forked from a zygote reports, when its cell ends, the modules that are in ``sys.modules``
now and were not in the zygote's (``new_modules``); the pool builds its next zygote with
them (``zygote.preload``). Only modules of the interpreter's own installation are ever
reported or imported there: the standard library, site-packages/dist-packages folders and
this package. The start directory and the cwd are shared, hostile folders; a module found
there (or anywhere else) is the cell's business, never the zygote's.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import site
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import elastic_magic

# The zygote's sys.modules once it has imported everything: set in the zygote (a forked
# worker inherits it); None in a fresh interpreter, which has nothing to report.
BASELINE: frozenset[str] | None = None
_reported: set[str] = set()  # by this worker already (a session's earlier cells)
_BUILT_IN = ("built-in", "frozen")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(elastic_magic.__file__))


def _real(path: str) -> str:
    return os.path.realpath(path)


def trusted_roots(sys_path: Iterable[str]) -> list[str]:
    """The folders of the interpreter's own installation: the standard library, its
    site-packages (the user's site included), the site-packages/dist-packages folders on
    ``sys_path`` (the fingerprint watches those), and elastic_magic's own folder."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    with contextlib.suppress(AttributeError):  # site may be replaced (virtualenv's old one)
        roots.update(site.getsitepackages())
        roots.add(site.getusersitepackages())
    roots.update(p for p in sys_path if Path(p).name in ("site-packages", "dist-packages"))
    roots.add(_PACKAGE_DIR)
    return sorted({_real(r) for r in roots if r})


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def is_trusted(origin: str | None, roots: list[str], cwd: str) -> bool:
    """A module file the zygote may import: built into the interpreter, or under one of
    ``roots`` that does not hold the cwd (a cwd inside site-packages makes it the user's
    folder: nothing there is trusted)."""
    if origin in _BUILT_IN:
        return True
    if not origin or not os.path.isabs(origin):
        return False
    real, here = _real(origin), _real(cwd)
    return any(_under(real, root) and not _under(here, root) for root in roots)


def origin_of(module: Any, name: str) -> str | None:
    """The file ``name`` was loaded from, or None when it cannot be imported by that name
    again (an alias such as ``os.path``, a module made in code, a namespace package)."""
    spec = getattr(module, "__spec__", None)
    if spec is None or getattr(spec, "name", None) != name:
        return None
    origin = getattr(spec, "origin", None)
    return origin if isinstance(origin, str) and origin != "namespace" else None


def new_modules() -> list[tuple[str, str]]:
    """(name, file) of what this pooled worker imported beyond its zygote and has not
    reported yet, in import order; only the deepest of each chain (importing
    ``xml.dom.minidom`` imports ``xml.dom``), only trusted files (the cwd the cell ran in
    is the user's). Empty in a fresh interpreter."""
    if BASELINE is None:
        return []
    roots, cwd = trusted_roots(sys.path), os.getcwd()
    fresh = {}
    for name, module in list(sys.modules.items()):
        if name in BASELINE or name in _reported or name == "__main__":
            continue
        origin = origin_of(module, name)
        if origin is not None and is_trusted(origin, roots, cwd):
            fresh[name] = origin
    _reported.update(fresh)
    parents = {name.rpartition(".")[0] for name in fresh}
    return [(name, origin) for name, origin in fresh.items() if name not in parents]


def _trusted_spec(spec: Any, roots: list[str], cwd: str) -> str | None:
    """Where ``spec`` would load from, when the zygote may import it; else None."""
    if spec.origin is not None and spec.origin != "namespace":
        return spec.origin if is_trusted(spec.origin, roots, cwd) else None
    places = list(spec.submodule_search_locations or [])  # a namespace package
    if places and all(is_trusted(p, roots, cwd) for p in places):
        return places[0]
    return None


def import_trusted(name: str, origin: str | None, roots: list[str], cwd: str) -> str | None:
    """Import ``name`` and each package above it, where every one resolves to a trusted
    file (and ``name`` to ``origin``, the file the worker had, where given); None when
    done, else why it was left out. Nothing untrusted is ever executed: where a module
    would come from is found before it is imported."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return "not a module name"
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if prefix in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(prefix)
        except BaseException as exc:  # a package's __init__ may raise anything
            return f"fails to import: {type(exc).__name__}: {exc}"[:300]
        if spec is None:
            return "not found"
        found = _trusted_spec(spec, roots, cwd)
        if found is None:
            return (f"{spec.origin or prefix} is not in the standard library or "
                    "site-packages (the pool imports nothing from the user's folders)")
        if prefix == name and origin is not None and _real(found) != _real(origin):
            return f"the pool would import {found}, the workers imported {origin}"
        try:
            importlib.import_module(prefix)
        except BaseException as exc:
            return f"fails to import: {type(exc).__name__}: {exc}"[:300]
    return None
