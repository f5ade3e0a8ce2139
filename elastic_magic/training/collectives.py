"""The job's process group as State and the data see it, and the State's small
collectives: flags and integers every rank must agree on, as tensors (nothing is
unpickled)."""

from __future__ import annotations

from typing import Any

from . import rng


def distributed() -> Any:
    """torch.distributed when the job has a default group (the automatic one is made
    now if nothing used it yet: State may come before any collective); else None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from ..worker import default_group

    return dist if default_group.ensure() else None


def distributed_unless_alone() -> Any:
    """``distributed()``, but None on a new rank that replays a session's setup cells alone: the
    survivors would never join a collective there."""
    from ..worker import replay_alone

    return None if replay_alone.replaying_alone() else distributed()


def rank_and_world() -> tuple[int, int]:
    dist = distributed()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


def broadcast_flag(dist: Any, flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a tensor collective: nothing is unpickled)."""
    import torch

    tensor = torch.tensor([int(flag)], dtype=torch.uint8, device=rng.collective_device(dist))
    dist.broadcast(tensor, src=0)
    return bool(tensor.item())


def gather_int(dist: Any, value: int) -> list[int]:
    """Every rank's ``value``, in rank order."""
    return [row[0] for row in gather_ints(dist, [value])]


def gather_ints(dist: Any, values: list[int]) -> list[list[int]]:
    """Every rank's ``values``, in rank order (a tensor collective: nothing unpickled)."""
    import torch

    device = rng.collective_device(dist)
    rows = [torch.empty(len(values), dtype=torch.int64, device=device)
            for _ in range(dist.get_world_size())]
    dist.all_gather(rows, torch.tensor(values, dtype=torch.int64, device=device))
    return [[int(v) for v in row.tolist()] for row in rows]
