"""Which of a new rank's missing names a session cell needs (``worker.cell_reads``): read in
the order the cell runs, through the functions and classes it defines and uses, and those of
the rank's namespace it calls."""

from __future__ import annotations

import textwrap

import pytest

from elastic_magic.worker.cell_reads import needed

pytestmark = pytest.mark.unit


def reads(source: str, space: dict | None = None) -> set[str]:
    return needed(textwrap.dedent(source), "<cell>", space or {})


def test_a_name_read_before_the_cell_binds_it_is_needed():
    assert "x" in reads("x = x + 1")
    assert "x" in reads("x += 1")
    assert "x" not in reads("x = 1\nprint(x)")
    assert "model" in reads("print(model)\nmodel = 2")
    assert {"a", "b"} <= reads("y = [a for _ in range(3)]\nz = {k: b for k in y}")


def test_names_local_to_comprehensions_and_lambdas_are_not_needed():
    assert reads("[model for model in range(3)]") == {"range"}
    assert reads("f = lambda model: model + 1\nf(2)") == set()
    assert reads("[x for row in rows for x in row if x]") == {"rows"}


def test_a_function_the_cell_defines_counts_once_the_cell_uses_it():
    assert "model" not in reads("def f():\n    return model\n")
    assert "model" in reads("def f():\n    return model\nf()")
    assert "model" in reads("def f():\n    return g()\ndef g():\n    return model\nf()")
    # what the cell binds before it calls the function is there when it runs
    assert "model" not in reads("def f():\n    return model\nmodel = 1\nf()")


def test_defaults_decorators_and_class_bodies_run_where_they_are_defined():
    assert "size" in reads("def f(n=size):\n    return n")
    assert "wrap" in reads("@wrap\ndef f():\n    pass")
    assert "base" in reads("class A(base):\n    pass")
    assert "width" in reads("class A:\n    w = width")


def test_functions_and_classes_of_the_namespace_are_followed():
    space: dict = {}
    exec(textwrap.dedent("""
        def train(steps):
            return model(steps)

        class Trainer:
            def fit(self):
                return optimizer

        def setup():
            global made
            made = 1
    """), space)  # as a cell defines them: their globals are the namespace
    assert "model" in reads("train(5)", space)
    assert "optimizer" in reads("Trainer().fit()", space)
    assert "model" not in reads("print(1)", space)
    assert "made" not in reads("setup()\nprint(made)", space)  # setup binds it
    # A library's function reads its own module's globals, not the namespace's.
    space["dumps"] = textwrap.dedent
    assert reads("dumps('x')", space) == {"dumps"}  # not textwrap's own globals


def test_a_class_body_reads_its_own_names_and_properties_their_own_setters():
    assert "w" not in reads("class A:\n    w = 1\n    v = w")
    source = ("class A:\n    @property\n    def value(self):\n        return 1\n"
              "    @value.setter\n    def value(self, v):\n        pass\n")
    assert "value" not in reads(source)


def test_imports_handlers_and_matches_bind_their_names():
    assert reads("import numpy as np\nnp.zeros(1)") == set()
    assert reads("import os.path\nos.getcwd()") == set()
    assert "err" not in reads("try:\n    pass\nexcept ValueError as err:\n    print(err)")
    assert "rest" not in reads("match [1, 2]:\n    case [a, *rest]:\n        print(a, rest)")


def test_a_cell_that_does_not_parse_raises_syntax_error():
    with pytest.raises(SyntaxError):
        reads("def (")
