"""The agent's copy of the elastic State: the latest committed snapshot, in memory and,
with a checkpoint directory, on disk (written atomically: a crash mid-write leaves the
previous checkpoint whole).

A commit is answered once the snapshot is kept in memory; the checkpoint is written behind
it on a thread (``CheckpointWriter``), which writes the newest snapshot it has not written
yet, so a slow disk delays the checkpoint, never the training. The job's end waits for it.

In memory, a snapshot is either bytes (from the pipe, another machine or a checkpoint) or
a descriptor of the anonymous memory file the committing worker wrote it into: the agent
keeps that file open instead of copying it, and workers read it back through /proc.
``StateServer`` answers the ranks' requests from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..events import Committed
from ..messages import Commit, CommitReply, Handoff, Reply, StateGet, StateReply, StateRequest

_DATA = "snapshot.pt"
_META = "snapshot.json"


@dataclass
class SnapshotStore:
    directory: Path | None = None
    commit_id: int = 0
    meta: dict[str, Any] | None = None
    _bytes: bytes | None = None
    _fd: int | None = None  # an anonymous memory file this store owns
    size: int = 0
    _writer: CheckpointWriter | None = field(default=None, repr=False)

    @property
    def blob(self) -> bytes | None:
        """The snapshot as bytes (a copy when it lives in a memory file)."""
        if self._fd is None:
            return self._bytes
        return os.pread(self._fd, self.size, 0)

    @property
    def memory_file(self) -> int | None:
        """The descriptor of the memory file holding the snapshot, if it is in one."""
        return self._fd

    def load_checkpoint(self) -> bool:
        """Take the snapshot a previous run left in the directory, if any."""
        if self.directory is None or not (self.directory / _META).exists():
            return False
        self.meta = json.loads((self.directory / _META).read_text())
        self._replace(data=(self.directory / _DATA).read_bytes())
        return True

    def commit(self, meta: dict[str, Any], *, data: bytes | None = None,
               fd: int | None = None) -> None:
        """Keep a new snapshot: ``data``, or the memory file ``fd`` (the store owns it)."""
        self._replace(data=data, fd=fd)
        self.meta = meta
        self.commit_id += 1
        if self.directory is not None:
            if self._writer is None:
                self._writer = CheckpointWriter(self.directory)
            self._writer.submit(meta, data if fd is None else os.dup(fd), self.size)

    def close(self) -> None:
        """Release the snapshot, once the checkpoint (if any) is on disk."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            self._replace()

    def _replace(self, data: bytes | None = None, fd: int | None = None) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._bytes, self._fd = data, fd
        self.size = os.fstat(fd).st_size if fd is not None else len(data or b"")


def _write_atomically(path: Path, source: bytes | int | None, size: int = 0) -> None:
    """Write ``source`` (bytes, or ``size`` bytes of a file descriptor) to a temporary file
    beside ``path``, fsync it, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(source, int):
                f.flush()
                offset = 0
                while offset < size:  # kernel to kernel: no copy through Python
                    sent = os.sendfile(f.fileno(), source, offset, size - offset)
                    if not sent:
                        raise OSError(f"snapshot ended at {offset} of {size} bytes")
                    offset += sent
            else:
                f.write(source or b"")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            Path(tmp).unlink()
        raise


class CheckpointWriter:
    """Writes the newest submitted snapshot to the checkpoint folder on its own thread;
    one that is superseded before its turn is skipped. An error is raised by the next
    ``submit`` or by ``close``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._cond = threading.Condition()
        self._pending: tuple[dict[str, Any], bytes | int | None, int] | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="elastic-checkpoint",
                                        daemon=True)
        self._thread.start()

    def submit(self, meta: dict[str, Any], source: bytes | int | None, size: int) -> None:
        """Queue a snapshot: bytes, or a descriptor that the writer then owns."""
        with self._cond:
            self._discard_pending()
            self._pending = (meta, source, size)
            self._cond.notify()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Write what is queued, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def _discard_pending(self) -> None:
        if self._pending is not None and isinstance(self._pending[1], int):
            os.close(self._pending[1])
        self._pending = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                (meta, source, size), self._pending = self._pending, None
            try:
                _write_atomically(self.directory / _DATA, source, size)
                _write_atomically(self.directory / _META, json.dumps(meta).encode())
            except BaseException as exc:
                with self._cond:
                    self._error = exc
            finally:
                if isinstance(source, int):
                    os.close(source)


class StateServer:
    """Answers ranks' State requests from the store: the head serves its own workers
    (memory files through /proc) and other machines' workers (bytes, ``inline``). Whether
    the ranks leave at a commit (a resize, machines waiting) is the loop's call:
    ``leave_at_commit``."""

    def __init__(self, store: SnapshotStore, emit: Callable[[Committed], None],
                 leave_at_commit: Callable[[], bool]) -> None:
        self.store = store
        self.emit = emit
        self.leave_at_commit = leave_at_commit

    def resume_from_checkpoint(self) -> None:
        """Take the snapshot a previous job left in the checkpoint folder, if any."""
        store = self.store
        if store.load_checkpoint():
            meta = store.meta or {}
            self.emit(Committed(meta.get("step"), meta.get("world_size", 0), store.size,
                                origin="checkpoint"))

    def get(self, inline: bool) -> StateReply:
        store = self.store
        if store.memory_file is not None and not inline:
            # The worker reads our memory file through /proc (or asks again, inline).
            return StateReply(store.commit_id, handoff=Handoff.of(store.memory_file))
        return StateReply(store.commit_id, snapshot=store.blob)

    def commit(self, request: Commit, world_size: int,
               memory_file: int | None = None) -> CommitReply:
        """Keep the snapshot (bytes in the request, or ``memory_file``, which the store
        then owns)."""
        meta = {"step": request.step, "time": request.time, "world_size": world_size}
        self.store.commit(meta, data=request.snapshot, fd=memory_file)
        self.emit(Committed(request.step, world_size, self.store.size))
        return CommitReply(resize=self.leave_at_commit())

    def serve(self, request: StateRequest, world_size: int, *, inline: bool) -> Reply:
        """A request whose snapshot, if any, came as bytes (another machine's rank)."""
        match request:
            case StateGet():
                return Reply(request.request_id, self.get(inline or request.inline))
            case Commit():
                return Reply(request.request_id, self.commit(request, world_size))
            case other:
                raise TypeError(f"not a State request: {other!r}")
