"""Small collectives of the State's: flags and integers every rank must agree on, as
tensors (nothing is unpickled)."""

from __future__ import annotations

from typing import Any

from . import rng


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
