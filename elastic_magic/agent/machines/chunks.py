"""Snapshot chunks between machines: State scales with the model, not with the kernel.

A chunk is what one commit's rank sends: its part of a sharded State, or the whole snapshot
of a replicated one. It crosses a signed link in pieces (``ChunkPiece``, at most ``PIECE``
bytes a frame) that the link's reader thread writes straight into an anonymous memory file
(``ChunkSink``): no chunk sits whole on either agent's Python heap, and the head's agent is
the notebook's kernel.

Where chunks live: each machine's agent keeps its own ranks' chunks in the memory files the
workers wrote (``HeldChunks``); the head keeps a copy of every other machine's chunks (it
needs them for the disk checkpoint and the commits' catalog), and sends a copy of its own
ranks' chunks to one joined machine. So losing a joined machine loses no commit; losing the
head's machine ends the job (the head cannot be replaced), but its chunks survive on that
peer. A restore on a joined machine takes the chunks of the commit it holds itself and
fetches only the rest from the head.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Protocol

from ...training.snapshot_format import part_spans, write_all_at
from ...wire.chunk_messages import ChunkKept, ChunkKey, ChunkPiece
from ...wire.link_messages import LinkMessage
from ..node.commit_files import copy_range

PIECE = 4 << 20  # bytes a frame: what a chunk in flight costs a heap


class LinkLike(Protocol):
    """What sending needs of a link (``hub.Link``)."""

    def send(self, message: LinkMessage) -> bool: ...


def memory_file(name: str = "elastic-chunk") -> int:
    return os.memfd_create(name, os.MFD_CLOEXEC)


def send_chunk(link: LinkLike, key: ChunkKey, source: bytes | int, start: int, size: int,
               at: int = 0) -> bool:
    """Send ``size`` bytes of ``source`` (bytes, or a descriptor read with pread) from
    ``start``, to be written at ``at`` in the peer's chunk ``key``. False once the link
    is gone."""
    done = 0
    view = memoryview(source) if isinstance(source, bytes) else None
    while done < size:
        n = min(PIECE, size - done)
        data = bytes(view[start + done:start + done + n]) if view is not None \
            else os.pread(source, n, start + done)  # type: ignore[arg-type]
        if not data:
            raise OSError(f"chunk ended at {start + done} of {start + size} bytes")
        if not link.send(ChunkPiece(key, at + done, data)):
            return False
        done += len(data)
    return True


def send_behind(link: LinkLike, key: ChunkKey, fd: int, then: LinkMessage) -> None:
    """Send the chunk in ``fd`` (a descriptor this call now owns), then ``then``, on a
    thread: the agent's loop goes on meanwhile. Nothing follows a chunk cut short."""
    def run() -> None:
        try:
            if send_chunk(link, key, fd, 0, os.fstat(fd).st_size):
                link.send(then)
        except OSError:
            pass  # the link went: the commit is not whole there, and that is told elsewhere
        finally:
            os.close(fd)

    threading.Thread(target=run, name="elastic-chunk-send", daemon=True).start()


def send_snapshot(link: LinkLike, key: ChunkKey, source: bytes | int, size: int,
                  token: int, have: tuple[tuple[int, int], ...]
                  ) -> tuple[tuple[int, int, int], ...] | None:
    """Send a snapshot (bytes, or a memory file's descriptor) but for the parts of commit
    ``token`` that the peer holds (``have``): those, as (part, token, offset), for the peer
    to fill in; None once the link is gone."""
    spans = part_spans(lambda n: source[:n] if isinstance(source, bytes)
                       else os.pread(source, n, 0))
    held = {part for part, of in have if token and of == token}
    local, at = [], 0
    for part, (start, length) in enumerate(spans or [(0, size)]):
        if part in held:
            if not send_chunk(link, key, source, at, start - at, at):
                return None
            local.append((part, token, start))
            at = start + length
    if not send_chunk(link, key, source, at, size - at, at):
        return None
    return tuple(local)


class PeerCopier:
    """Sends copies of this machine's ranks' chunks to a peer, on one thread, newest
    first: a copy superseded (the part's next commit) before it left is dropped, so a
    slow link costs the commits' copies, never memory without bound."""

    def __init__(self) -> None:
        # part -> link, token, and the chunk: a descriptor, where in it, its size
        self._pending: dict[int, tuple[LinkLike, int, tuple[int, int, int]]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="elastic-chunk-copy",
                                        daemon=True)
        self._thread.start()

    def submit(self, link: LinkLike, part: int, token: int,
               chunk: tuple[int, int, int]) -> None:
        """Copy part ``part`` of commit ``token`` to ``link``'s peer: ``chunk`` is a
        descriptor (now ours), where the part starts in it, and its size."""
        with self._cond:
            old = self._pending.pop(part, None)
            self._pending[part] = (link, token, chunk)
            self._cond.notify()
        if old is not None:
            os.close(old[2][0])

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                part = next(iter(self._pending))
                link, token, (fd, start, size) = self._pending.pop(part)
            try:
                if send_chunk(link, ("copy", part, token, size), fd, start, size):
                    link.send(ChunkKept(part, token, size))
            except OSError:
                pass  # the link went: that peer holds no copy, which it reports itself
            finally:
                os.close(fd)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, {}
            self._cond.notify()
        for _, _, (fd, _, _) in pending.values():
            os.close(fd)
        self._thread.join(timeout=5)


class ChunkSink:
    """Chunks arriving, by (link, key), each in a memory file of its own; written on the
    links' reader threads, taken on the agent's loop."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, ChunkKey], int] = {}
        self._lock = threading.Lock()

    def write(self, node: int, piece: ChunkPiece) -> None:
        with self._lock:
            fd = self._files.get((node, piece.key))
            if fd is None:
                fd = self._files[(node, piece.key)] = memory_file()
        write_all_at(fd, piece.data, piece.offset)

    def take(self, node: int, key: ChunkKey, size: int | None = None) -> int | None:
        """The chunk's memory file, now the caller's; None unless ``size`` bytes came
        (unchecked without ``size``: an empty file if nothing came)."""
        with self._lock:
            fd = self._files.pop((node, key), None)
        if fd is None and not size:
            return memory_file()
        if fd is not None and size is not None and os.fstat(fd).st_size != size:
            os.close(fd)
            return None
        return fd

    def drop(self, node: int | None = None) -> None:
        """Forget the chunks of a link that went (every link's, without ``node``)."""
        with self._lock:
            gone = [k for k in self._files if node is None or k[0] == node]
            fds = [self._files.pop(k) for k in gone]
        for fd in fds:
            os.close(fd)


class HeldChunks:
    """The chunks this machine keeps: part -> (its commit's token, its memory file), of one
    commit: a newer commit's first chunk drops the older's (the head has them all), so a
    world that shrank leaves no chunk behind."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def keep(self, part: int, token: int, fd: int) -> None:
        """Keep ``fd`` (now ours) as part ``part`` of commit ``token``."""
        with self._lock:
            old = [self._held.pop(p) for p, (t, _) in list(self._held.items())
                   if p == part or t != token]
            self._held[part] = (token, fd)
        for _, held in old:
            os.close(held)

    def have(self) -> tuple[tuple[int, int], ...]:
        with self._lock:
            return tuple((part, token) for part, (token, _) in sorted(self._held.items())
                         if token)

    def copy_into(self, out: int, part: int, token: int, offset: int) -> bool:
        """Write part ``part`` of commit ``token`` at ``offset`` of the memory file
        ``out``; False if it is no longer held (a newer commit's replaced it)."""
        with self._lock:
            token_held, fd = self._held.get(part, (0, -1))
            if token_held != token:
                return False
            source = os.dup(fd)
        try:
            copy_range(source, 0, out, offset, os.fstat(source).st_size)
        finally:
            os.close(source)
        return True

    def close(self) -> None:
        with self._lock:
            held, self._held = self._held, {}
        for _, fd in held.values():
            with contextlib.suppress(OSError):
                os.close(fd)
