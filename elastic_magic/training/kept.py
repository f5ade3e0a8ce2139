"""A rank's own record of the last commit it took part in (survivors going on in place,
``training/resume.py``): a survivor rolls back from it, without reading the agent's copy, while the
objects holding large tensors are as they were at the commit. Their tensors' storage and
version counters say so (a failure in the step's collectives, before the optimizer step,
changed nothing); small objects and the values are kept as copies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

COPY_LIMIT = 1 << 20  # an object's state up to this many tensor bytes is kept as a copy


def _signature(tree: Any) -> Any:
    """``tree`` with each tensor replaced by its storage and version counter: equal while
    no tensor was written in place or replaced."""
    import torch

    if isinstance(tree, torch.Tensor):
        return ("tensor", tree.data_ptr(), tree._version, tuple(tree.shape))
    if isinstance(tree, dict):
        return {key: _signature(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_signature(value) for value in tree]
    return tree


def _tensor_bytes(tree: Any) -> int:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(map(_tensor_bytes, tree.values()))
    if isinstance(tree, (list, tuple)):
        return sum(map(_tensor_bytes, tree))
    return 0


@dataclass
class Kept:
    """What a rank needs to roll back to the commit without reading the agent's copy."""

    token: int  # the commit's, as the agent has it
    values: dict[str, Any]
    commits: int
    rng: dict[str, Any]
    world_size: int
    copies: dict[str, Any]  # small objects' state, copied
    signatures: dict[str, Any]  # large objects' state: tensors as versions

    @classmethod
    def of(cls, token: int, dicts: dict[str, Any], values: dict[str, Any], commits: int,
           rngs: list[dict[str, Any]], rank: int) -> Kept | None:
        """None where the values hold large tensors: copying them at every commit would
        cost the training more than reading the agent's copy at a rollback."""
        if _tensor_bytes(values) > COPY_LIMIT:
            return None
        copies, signatures = {}, {}
        for name, tree in dicts.items():
            if _tensor_bytes(tree) <= COPY_LIMIT:
                copies[name] = copy.deepcopy(tree)
            else:
                signatures[name] = _signature(tree)
        return cls(token, copy.deepcopy(values), commits, rngs[rank], len(rngs), copies,
                   signatures)

    def holds(self, token: int, objects: dict[str, Any]) -> bool:
        """Whether this is the agent's latest commit (``token``) and every large object is
        as it was then."""
        if not token or token != self.token or set(objects) != {*self.copies,
                                                                 *self.signatures}:
            return False
        try:
            return all(_signature(objects[name].state_dict()) == signature
                       for name, signature in self.signatures.items())
        except Exception:  # a state we cannot compare: read the agent's copy
            return False

    def roll_back(self, state: Any, world_size: int) -> None:
        from . import rng

        state._values.update(copy.deepcopy(self.values))
        object.__setattr__(state, "_commits", self.commits)
        for name, tree in self.copies.items():
            state._objects[name].load_state_dict(copy.deepcopy(tree))
        rng.apply(self.rng)
        if self.world_size != world_size and state._on_resize is not None:
            state._on_resize(self.world_size, world_size)
