"""Which of a namespace's names a cell needs: those it reads before it binds them, itself or
through the functions and classes it calls.

A session's new rank that lacks some of the survivors' variables checks each cell with this
before it runs (``namespace_ship.check``). The cell's own statements are read in order, so
``x = x + 1`` needs ``x`` and ``x = 1; print(x)`` does not; the body of a function the cell
defines counts only once the cell uses that function (``def f(): return model`` alone does
not need ``model``); a class body runs where it is defined, so it counts at once. Control
flow is read straight through: a name bound in one branch counts as bound after it, and
what the functions the cell calls bind (``global x``) or what the cell binds after a call
counts as bound for the code those functions run (the check lets such a cell run rather
than refuse one that would have)."""

from __future__ import annotations

import ast
import dis
import types
from collections.abc import Iterator
from typing import Any


def needed(source: str, filename: str, space: dict[str, Any]) -> set[str]:
    """The global names the cell ``source`` reads before binding them: at its top level,
    in the functions and classes it defines and uses, and in those of ``space`` (the
    rank's namespace) that it uses, followed as far as they go. Raises SyntaxError."""
    tree = ast.parse(source, filename)
    order = _InOrder()
    order.visit(tree)
    defined = {code.co_name: code for code in compile(tree, filename, "exec").co_consts
               if isinstance(code, types.CodeType)}
    todo = [*order.read, *(order.loaded & order.defined), *order.classes]
    seen: set[str] = set()
    through: set[str] = set()  # read inside functions: the cell may bind them first
    stored: set[str] = set()  # bound by those functions (``global x; x = ...``)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in order.defined and name in defined:
            codes: Iterator[types.CodeType] = iter((defined[name],))
        elif name in space:
            codes = code_of(space[name], space)
        else:
            continue
        for code in codes:
            reads, binds = _globals(code)
            stored |= binds
            through |= reads
            todo.extend(reads)
    # what a called function binds (``global x``) counts as bound, wherever the call is
    return (order.read | (through - order.bound)) - stored


def _globals(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The global names ``code`` and the code nested in it read (as Python scopes them; a
    class body's own names, stored and read there by name, are not global), and those it
    binds (``global x; x = ...``), in one pass over its instructions."""
    reads: set[str] = set()
    binds: set[str] = set()
    for each in _nested(code):
        instructions = list(dis.get_instructions(each))
        own = {ins.argval for ins in instructions if ins.opname == "STORE_NAME"}
        for ins in instructions:
            if ins.opname == "LOAD_GLOBAL" or (ins.opname == "LOAD_NAME"
                                                and ins.argval not in own):
                reads.add(ins.argval)
            elif ins.opname == "STORE_GLOBAL":
                binds.add(ins.argval)
    return reads, binds


def code_of(value: Any, space: dict[str, Any] | None = None) -> Iterator[types.CodeType]:
    """The code a namespace value runs when called: a function's, a class's methods';
    given ``space``, only code whose globals are that namespace (a library's function reads
    its own module's globals, not the cells')."""
    functions: list[Any] = [value] if isinstance(value, types.FunctionType) else []
    if isinstance(value, type):
        functions = [getattr(attr, "__func__", attr)  # staticmethod, classmethod
                     for attr in vars(value).values()]
    for fn in functions:
        if isinstance(fn, types.FunctionType) and (space is None or fn.__globals__ is space):
            yield fn.__code__


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


class _InOrder(ast.NodeVisitor):
    """The cell's top level in the order it runs: ``read``, the names loaded before any
    binding of them; ``loaded``, every name loaded; ``bound``, every name bound;
    ``defined``, the functions and classes it defines (their bodies wait, a class's is
    followed at once: ``classes``)."""

    def __init__(self) -> None:
        self.read: set[str] = set()
        self.loaded: set[str] = set()  # read at all (a function the cell defines: called)
        self.bound: set[str] = set()
        self.defined: set[str] = set()
        self.classes: list[str] = []
        self._local: list[set[str]] = []  # the scopes of lambdas and comprehensions

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if any(node.id in scope for scope in self._local):
                return
            self.loaded.add(node.id)
            if node.id not in self.bound:
                self.read.add(node.id)
        elif self._local and isinstance(node.ctx, ast.Store):
            self._local[-1].add(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)  # the value runs before the names are bound
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):  # x += 1 reads x first
            self.visit(ast.Name(node.target.id, ast.Load()))
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    visit_AsyncFor = visit_For

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(expr)  # run where it is defined; the body waits for a call
        self.defined.add(node.name)
        self.bound.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self.defined.add(node.name)
        self.classes.append(node.name)  # its body runs here (compiled, it is followed)
        self.bound.add(node.name)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *(d for d in node.args.kw_defaults if d)]:
            self.visit(expr)
        arguments = node.args
        names = {a.arg for a in [*arguments.posonlyargs, *arguments.args,
                                 *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
                 if a is not None}
        self._local.append(names)
        self.visit(node.body)
        self._local.pop()

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp
                       | ast.DictComp) -> None:
        self.visit(node.generators[0].iter)  # the outermost runs in the enclosing scope
        self._local.append(set())
        for i, generator in enumerate(node.generators):
            for part in [generator.iter] * (i > 0) + [generator.target, *generator.ifs]:
                self.visit(part)
        for part in [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]:
            self.visit(part)
        self._local.pop()

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self.bound.add(alias.asname or alias.name.partition(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for statement in node.body:
            self.visit(statement)

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.pattern is not None:
            self.visit(node.pattern)
        if node.name:
            self.bound.add(node.name)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self.bound.add(node.name)
