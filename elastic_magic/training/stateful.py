"""What ``State`` restores in place: objects with ``state_dict``/``load_state_dict`` (a DDP
model unwrapped, a torch.Generator through its state), and what it refuses outright."""

from __future__ import annotations

import io
import socket
import types
from typing import Any


def unwrap(obj: Any) -> Any:
    """The model inside a DDP or DataParallel wrapper (its state_dict has no prefix)."""
    from torch.nn import DataParallel
    from torch.nn.parallel import DistributedDataParallel

    return obj.module if isinstance(obj, (DistributedDataParallel, DataParallel)) else obj


class GeneratorState:
    """A torch.Generator as a stateful object."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> Any:
        return self.generator.get_state()

    def load_state_dict(self, state: Any) -> None:
        self.generator.set_state(state)


def stateful_of(name: str, value: Any) -> Any:
    """What restores ``value`` in place, or None for a plain value; refuses what cannot
    be restored at all."""
    import torch

    if isinstance(value, torch.Generator):
        return GeneratorState(value)
    if type(value).__name__ == "StatefulDataLoader":
        raise TypeError(
            f"State cannot restore {name}=StatefulDataLoader exactly: torchdata keeps each "
            "rank's own position, which does not carry over to another world size (a resize "
            "would skip or repeat samples). Use elastic_magic.DataLoader (same arguments)")
    if callable(getattr(value, "state_dict", None)) and callable(
            getattr(value, "load_state_dict", None)):
        return unwrap(value)
    if isinstance(value, (types.GeneratorType, io.IOBase, socket.socket)) or (
            hasattr(value, "__next__") and hasattr(value, "__iter__")):
        raise TypeError(
            f"State cannot restore {name}={type(value).__name__}: it has no state to save. "
            "Pass objects with state_dict()/load_state_dict() (restored in place) or plain "
            "values (numbers, strings, tensors, lists and dicts of them); make iterators "
            "and open files again after State(...) from what it restored")
    return None
