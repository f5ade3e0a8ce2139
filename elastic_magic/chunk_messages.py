"""The messages that carry snapshot chunks between machines (``agent/machines/chunks.py``),
part of ``messages.LinkMessage``."""

from __future__ import annotations

from dataclasses import dataclass

ChunkKey = tuple[str, int, int, int]


@dataclass(frozen=True)
class ChunkPiece:
    """Bytes of a snapshot chunk, written at ``offset`` of the receiver's memory file for
    ``key``: a chunk never sits whole on a heap (``agent/machines/chunks.py``)."""

    key: ChunkKey
    offset: int
    data: bytes


@dataclass(frozen=True)
class ChunkKept:
    """A head rank's chunk, sent as pieces keyed ``("copy", part, token, size)``: keep it."""

    part: int
    token: int
    size: int
