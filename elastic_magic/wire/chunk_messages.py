"""How a snapshot's bytes cross: between processes, a memory file offered through /proc
(``Handoff``); between machines, chunks in pieces (``agent/machines/chunks.py``), part of
``link_messages.LinkMessage``."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Handoff:
    """A memory file offered to the peer, which opens it through /proc (same user, no copy
    through a pipe)."""

    pid: int
    fd: int
    size: int

    @classmethod
    def of(cls, fd: int) -> Handoff:
        """Offer this process's descriptor ``fd``."""
        return cls(os.getpid(), fd, os.fstat(fd).st_size)

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


@dataclass(frozen=True)
class CommitTarget:
    """Where to write this rank's part of commit ``token`` (parts of ``sizes`` bytes, in
    rank order): answered with a CommitReply whose ``target`` is the agent's memory file
    for it, or none (then the part is sent as before: a file of the worker's, or bytes)."""

    request_id: int
    token: int
    sizes: tuple[int, ...]


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
