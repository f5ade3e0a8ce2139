"""A new rank of a session replays the setup cells while the survivors wait (``--survivors``).

The session's process group is made first, on every rank, so that a setup cell may ask
for its rank, the world size or its device as it would in any cell. A collective would
wait for ever: the survivors do not run setup cells (they kept what those made). So while a
setup cell is replayed alone, torch.distributed's collectives raise :class:`AloneError` at
once, before anything is sent; the session then starts every rank again and replays the
setup cells on all of them, as without ``--survivors``.

The refusing functions stand in for torch's only while the replay runs, and they refuse
only then: a setup cell that imported one by name (``from torch.distributed import
all_reduce``) keeps a function that calls torch's afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from elastic_magic import torch_internals

# What sends to or waits for other ranks: the collectives, point to point, the object
# collectives, new groups (every rank must make them) and a new default group; what DDP's
# constructor calls first comes from torch_internals.
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier",
    "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object",
    "init_process_group", "irecv", "isend", "monitored_barrier", "new_group",
    "new_subgroups", "recv", "recv_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "send_object_list",
    "split_group",
)

_replaying = False


class AloneError(RuntimeError):
    """A setup cell replayed on a new rank alone used a collective."""


def replaying_alone() -> bool:
    """A setup cell is being replayed on this new rank alone: what would be a collective
    elsewhere (``State``'s check that every rank restored the same commit) is skipped."""
    return _replaying


def _refusing(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _replaying:
            raise AloneError(
                f"torch.distributed.{name} in a setup cell replayed on a new rank: the "
                "survivors do not run setup cells, so a collective there would wait for "
                "them for ever. The session starts every rank again instead (as without "
                "--survivors). Keep collectives and DDP out of setup cells to keep the "
                "survivors: do them in an ordinary cell.")
        return original(*args, **kwargs)

    return refuse


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """While a setup cell is replayed alone: torch.distributed's collectives refuse,
    wherever torch or the cell reaches them by name."""
    global _replaying
    names = (*COLLECTIVES, *torch_internals.private_collectives())
    patched: list[tuple[Any, str, Any, Any]] = []  # module, name, torch's, ours
    for module in torch_internals.modules_calling_collectives():
        for name in names:
            if (original := module.__dict__.get(name)) is not None:
                refuse = _refusing(name, original)
                setattr(module, name, refuse)
                patched.append((module, name, original, refuse))
    _replaying = True
    try:
        yield
    finally:
        _replaying = False
        for module, name, original, refuse in patched:
            if module.__dict__.get(name) is refuse:  # what the cell set there stays
                setattr(module, name, original)


def make_group() -> None:
    """Every rank, survivors and new, before a new rank replays the setup cells: the
    session's process group (its first use makes it)."""
    import torch.distributed as dist

    dist.get_rank()
