"""Callbacks that do not keep their object alive.

An object that hands one of its own methods to something it owns (the head to its launcher,
a job to its agent's parts) makes a reference cycle, which only Python's cyclic collector
frees, at a time no one chooses. Until then, everything the object holds stays: a finished
job's result with its last commit (a memory file as large as the training state), stores,
sockets. ``weakly`` hands over the method without the object."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def weakly(method: Callable[P, R], gone: R) -> Callable[P, R]:
    """``method`` (a bound method), called while its object lives; ``gone`` once not."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        alive = ref()
        return gone if alive is None else alive(*args, **kwargs)

    return call
