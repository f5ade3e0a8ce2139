"""The names through which torch.distributed's collectives are called, for a rank that
replays a session's setup cells alone (``worker/replay_alone.py``): the private functions
DDP's constructor calls first, and the modules that imported collectives by name. Part of
``torch_internals``: the same rules (every private name a :class:`Need`, checked before
use)."""

from __future__ import annotations

import sys
from typing import Any

from . import Need, _get

BROADCAST_COALESCED: Need = Need(
    "torch.distributed", "_broadcast_coalesced",
    why="to refuse DDP's first broadcast on a rank that replays setup cells alone")
VERIFY_PARAMS: Need = Need(
    "torch.distributed", "_verify_params_across_processes",
    why="to refuse DDP's parameter check on a rank that replays setup cells alone")
MESH_COLLECTIVES: Need = Need(
    "torch.distributed.tensor._collective_utils", "broadcast",
    why="to refuse DTensor's collectives (imported there by name) on a rank alone")
NEEDS: tuple[Need, ...] = (BROADCAST_COALESCED, VERIFY_PARAMS, MESH_COLLECTIVES)


def private_collectives() -> tuple[str, ...]:
    """The private ``torch.distributed`` functions that wait for the other ranks: what
    DDP's constructor calls first (``worker/replay_alone.py`` refuses them with the public
    collectives)."""
    for need in (BROADCAST_COALESCED, VERIFY_PARAMS):
        _get(need)
    return (BROADCAST_COALESCED.name, VERIFY_PARAMS.name)


def modules_calling_collectives() -> list[Any]:
    """The modules through whose names collectives are called, those already imported:
    torch.distributed, its c10d module, and those that imported collectives by name
    (DeviceMesh's, DTensor's helpers). One imported later binds the names as they are
    then."""
    names = ("torch.distributed", "torch.distributed.distributed_c10d",
             "torch.distributed.device_mesh", MESH_COLLECTIVES.module)
    return [sys.modules[name] for name in names if name in sys.modules]
