"""Sharded tensors (FSDP2's ``fully_shard``, DTensor) in the elastic State: each rank commits
its own chunks with their place in the whole, and a restore at any world size assembles each
rank's new chunk from the committed chunks that overlap it.

A commit replaces every DTensor of a state dict by a :class:`ShardedTensor` (its key, the
global shape and dtype, sharded or replicated) and hands each rank's local chunk out beside
it, keyed the same, with the offset of its first row: rank 0's part of the snapshot holds
the tree, every rank's part its chunks (a replicated tensor's only on rank 0). A restore
takes the placement from what it restores into (the object's own state dict after the user
re-made the model; for an optimizer's moments before its first step, the mesh of its
parameters): a DTensor gets this rank's rows, a plain tensor (a DDP or unsharded model, or
the kernel reading a result) the whole tensor. Rows go to ranks as ``torch.chunk`` deals
them, as FSDP2 does: ceil(rows / ranks) each, the last ones shorter or empty.

Supported: DTensors on a 1-D mesh over every rank of the job, sharded on dim 0
(``Shard(0)``, FSDP2's layout) or replicated. Anything else (tensor parallelism sharding
another dim, 2-D meshes such as HSDP, partial sums, a mesh over some ranks) is refused when
the State is made and again at a commit, never saved wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("State supports DTensors (FSDP2's fully_shard) on a 1-D device mesh over all "
             "ranks, sharded on dim 0 (Shard(0)) or replicated (Replicate()); tensor "
             "parallelism (Shard on another dim), 2-D meshes (HSDP, FSDP + TP) and Partial "
             "placements are not supported: save those with torch.distributed.checkpoint")

Key = tuple[Any, ...]


class Unsupported(TypeError):
    """A sharded tensor State cannot save exactly."""


@dataclass(frozen=True)
class ShardedTensor:
    """Where a DTensor was, in the committed tree."""

    key: Key
    shape: tuple[int, ...]
    dtype: str
    replicated: bool


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def _layout(tensor: Any, where: str) -> bool:
    """Whether the DTensor ``tensor`` is replicated (else sharded on dim 0); refuses any
    other layout, naming ``where``."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = tensor.device_mesh, tuple(tensor.placements)
    problem = None
    if mesh.ndim != 1:
        problem = f"is on a {mesh.ndim}-D device mesh"
    elif placements not in ((Shard(0),), (Replicate(),)):
        problem = f"has placements {placements}"
    else:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if mesh.mesh.flatten().tolist() != list(range(world)):
            problem = f"is on a mesh over ranks {mesh.mesh.flatten().tolist()}, not all {world}"
    if problem:
        raise Unsupported(f"State cannot save {where}: it {problem}. {SUPPORTED}")
    return placements == (Replicate(),)


def _leaves(tree: Any, key: Key = ()) -> Iterator[tuple[Key, Any]]:
    if isinstance(tree, dict):
        for name, value in tree.items():
            yield from _leaves(value, (*key, name))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, (*key, i))
    else:
        yield key, tree


def check(name: str, obj: Any) -> bool:
    """Whether ``obj`` (a stateful object given to State) holds DTensors; refuses one State
    cannot save. Its state dict, and an optimizer's parameters (its moments are made at the
    first step, like them)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    params = [p for group in getattr(obj, "param_groups", ()) for p in group["params"]]
    found = False
    for key, value in [*_leaves(obj.state_dict(), (name,)), *(((name, "param"), p)
                                                             for p in params)]:
        if isinstance(value, dtensor):
            _layout(value, "/".join(map(str, key)))
            found = True
    return found


def _rows(rows: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows [start, end) that ``torch.chunk`` deals rank ``rank`` of ``ranks``."""
    size = -(-rows // ranks)
    start = min(rank * size, rows)
    return start, min(start + size, rows)


@dataclass
class Split:
    """A state dict's DTensors taken out: this rank's chunks, and whether there were any
    (the same on every rank)."""

    chunks: dict[Key, tuple[int, Any]]
    sharded: bool = False


def split(tree: Any, rank: int, key: Key, into: Split) -> Any:
    """``tree`` with each DTensor replaced by a ShardedTensor; this rank's chunks go
    ``into``."""
    return _split(tree, rank, key, into, _dtensor_type())


def _split(tree: Any, rank: int, key: Key, into: Split, dtensor: Any) -> Any:
    chunks = into.chunks
    if dtensor is not None and isinstance(tree, dtensor):
        into.sharded = True
        replicated = _layout(tree, "/".join(map(str, key)))
        local = tree.to_local().detach()
        shape = tuple(tree.shape)
        if replicated:
            if rank == 0:
                chunks[key] = (0, local)
        else:
            start, end = _rows(shape[0], tree.device_mesh.get_local_rank(),
                               tree.device_mesh.size())
            if local.shape[0] != end - start:
                raise Unsupported(f"State cannot save {'/'.join(map(str, key))}: its local "
                                  f"chunk has {local.shape[0]} rows where torch.chunk deals "
                                  f"{end - start}. {SUPPORTED}")
            chunks[key] = (start, local)
        return ShardedTensor(key, shape, str(tree.dtype).removeprefix("torch."), replicated)
    if isinstance(tree, dict):
        items = {name: _split(value, rank, (*key, name), into, dtensor)
                 for name, value in tree.items()}
        if all(items[name] is value for name, value in tree.items()):
            return tree
        out = copy.copy(tree)  # keeps an OrderedDict's _metadata (module versions)
        out.update(items)
        return out
    if isinstance(tree, (list, tuple)):
        values = [_split(value, rank, (*key, i), into, dtensor)
                  for i, value in enumerate(tree)]
        if all(a is b for a, b in zip(values, tree, strict=True)):
            return tree
        return type(tree)(values) if isinstance(tree, list) or type(tree) is tuple \
            else type(tree)(*values)
    return tree


class Chunks:
    """The committed chunks, from a snapshot's parts (``part(i)``: rank i's, read when
    first needed): rank i of the ``ranks`` that committed held the rows torch.chunk dealt
    it, so only the parts overlapping the rows asked for are read."""

    def __init__(self, part: Callable[[int], Any], ranks: int) -> None:
        self.part = part
        self.ranks = ranks

    def overlapping(self, marker: ShardedTensor, start: int, end: int) -> list[tuple[int, Any]]:
        """The committed (first row, chunk) pairs of ``marker`` holding rows [start, end)."""
        rows = marker.shape[0] if marker.shape else 0
        indices = [0] if marker.replicated or not marker.shape else [
            i for i in range(self.ranks) if _overlap(_rows(rows, i, self.ranks), start, end)]
        found = (self.part(i).get("chunks", {}).get(marker.key) for i in indices)
        return [chunk for chunk in found if chunk is not None]


def _overlap(rows: tuple[int, int], start: int, end: int) -> bool:
    return max(rows[0], start) < min(rows[1], end)


def _assemble(marker: ShardedTensor, chunks: Chunks, start: int, end: int) -> Any:
    """Rows [start, end) of the committed tensor, from the chunks that overlap them."""
    import torch

    found = chunks.overlapping(marker, start, end)
    if not marker.shape:  # a replicated scalar
        return found[0][1].clone()
    out = torch.empty((end - start, *marker.shape[1:]), dtype=getattr(torch, marker.dtype))
    covered = 0
    for first, chunk in found:
        low, high = max(start, first), min(end, first + chunk.shape[0])
        if low < high:
            out[low - start:high - start] = chunk[low - first:high - first]
            covered += high - low
    if covered != end - start:
        raise RuntimeError(f"the commit lacks rows of {'/'.join(map(str, marker.key))}: "
                           f"{covered} of {end - start}; it was not restored")
    return out


def _place(marker: ShardedTensor, chunks: Chunks, template: Any, mesh: Any) -> Any:
    """The committed tensor laid out as ``template`` (a DTensor or a plain tensor of the
    object restored into), or, without one, on ``mesh`` (None: whole)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(template, DTensor):
        where = "/".join(map(str, marker.key))
        if tuple(template.shape) != marker.shape:
            raise RuntimeError(f"cannot restore {where}: committed with shape "
                               f"{marker.shape}, the model now has {tuple(template.shape)}")
        replicated = _layout(template, where)
        mesh, device = template.device_mesh, template.to_local().device
    elif mesh is not None:
        replicated, (mesh, device) = marker.replicated, mesh
    else:
        rows = marker.shape[0] if marker.shape else 0
        whole = _assemble(marker, chunks, 0, rows)
        return whole.to(template.device) if isinstance(template, torch.Tensor) else whole
    rows = marker.shape[0] if marker.shape else 0
    start, end = (0, rows) if replicated else _rows(rows, mesh.get_local_rank(), mesh.size())
    local = _assemble(marker, chunks, start, end).to(device)
    placement = Replicate() if replicated else Shard(0)
    return DTensor.from_local(local, mesh, [placement], run_check=False,
                              shape=torch.Size(marker.shape), stride=_contiguous(marker.shape))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def resolve(tree: Any, chunks: Chunks, obj: Any, name: str) -> Any:
    """``tree`` (committed as ``name``) with its ShardedTensors made tensors for this rank,
    laid out as in ``obj`` (the object restored into); whole tensors committed unsharded
    (DDP) are sharded where ``obj`` is. ``tree`` itself when there is nothing to lay out."""
    dtensor = _dtensor_type()
    templates = dict(_leaves(obj.state_dict(), (name,))) if obj is not None else {}
    params = [p for group in getattr(obj, "param_groups", ()) for p in group["params"]]
    if dtensor is not None and params:  # an optimizer's moments: laid out as their parameter
        for key, value in _leaves(tree, (name,)):
            if (key not in templates and len(key) == 4 and key[1] == "state"
                    and isinstance(key[2], int) and key[2] < len(params)
                    and isinstance(params[key[2]], dtensor)
                    and tuple(getattr(value, "shape", ())) == tuple(params[key[2]].shape)):
                templates[key] = params[key[2]]
    if not any(isinstance(value, ShardedTensor) for _, value in _leaves(tree)) and not any(
            dtensor is not None and isinstance(value, dtensor) for value in templates.values()):
        return tree
    mesh = None  # without a template: its parameters' mesh
    for param in params:
        if dtensor is not None and isinstance(param, dtensor) and mesh is None:
            mesh = (param.device_mesh, param.to_local().device)
    return _resolve(tree, chunks, templates, mesh, (name,), dtensor)


def _resolve(tree: Any, chunks: Chunks, templates: dict[Key, Any], mesh: Any, key: Key,
             dtensor: Any) -> Any:
    if isinstance(tree, ShardedTensor):
        return _place(tree, chunks, templates.get(tree.key), mesh)
    template = templates.get(key)
    if dtensor is not None and isinstance(template, dtensor) and hasattr(tree, "shape") \
            and not isinstance(tree, dtensor) and tuple(tree.shape) == tuple(template.shape):
        whole = ShardedTensor(key, tuple(tree.shape), str(tree.dtype).removeprefix("torch."),
                              replicated=False)  # committed whole, by rank 0 (DDP)
        return _place(whole, Chunks(lambda _: {"chunks": {key: (0, tree)}}, 1), template, mesh)
    if isinstance(tree, dict):
        out = copy.copy(tree)
        out.update({name: _resolve(value, chunks, templates, mesh, (*key, name), dtensor)
                    for name, value in tree.items()})
        return out
    if isinstance(tree, list):
        return [_resolve(value, chunks, templates, mesh, (*key, i), dtensor)
                for i, value in enumerate(tree)]
    if type(tree) is tuple:
        return tuple(_resolve(value, chunks, templates, mesh, (*key, i), dtensor)
                     for i, value in enumerate(tree))
    return tree
