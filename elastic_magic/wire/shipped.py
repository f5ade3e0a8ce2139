"""A survivor's namespace on its way to the ranks that join a session (survivors stay): what
rank ``source`` defined that the new ranks lack, each value cloudpickled on its own (the
agent passes the bytes on without loading them; a new rank loads them, only from its
control pipe, whose frames are signed with the job's key), and what was not sent, and why
(``worker/namespace_ship.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShippedNamespace:
    """Rank ``source``'s variables for the new ranks: values by value, modules by name."""

    source: int
    values: dict[str, bytes] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # name -> module to import
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was not sent
    # functions and classes the new ranks have under another definition (an older one, from
    # a setup cell): the survivor's replaces theirs
    redefined: frozenset[str] = frozenset()
