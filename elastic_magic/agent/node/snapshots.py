"""The agent's copy of the elastic State: the latest committed snapshot, in memory and,
with a checkpoint directory, on disk (written atomically: a crash mid-write leaves the
previous checkpoint whole).

A commit is answered once the snapshot is kept in memory; the checkpoint is written behind
it on a thread (``CheckpointWriter``), which writes the newest snapshot it has not written
yet, so a slow disk delays the checkpoint, never the training. The job's end waits for it.

Loading a checkpoint unpickles it (in the workers): one that someone else planted would run
their code. So every checkpoint is signed with the user's key and loaded only once the
signature checks (``checkpoint_file``): one written with another key, changed or cut short
is refused; and one that is not the latest its folder held (an older one of the user's put
in its place) is refused too (``checkpoint_folder``). As a second line, the folder is opened
once, through folders and links no one else could change, checked on its descriptor (the
user's, no one else may write to it), and the files are read only if they are the user's
too (not links, no one else may write them); they are written new (``O_EXCL |
O_NOFOLLOW``) relative to that descriptor, then renamed into place.

A checkpoint is one file, ``checkpoint.em``: its metadata (the step printed on resume and
kept as ``JobResult.commit``) in a header before the snapshot, so one rename replaces both
and they always agree. A write that a crash interrupted leaves a temporary file: the next
job that opens the folder removes those (``.checkpoint.em.<hex>``, and the two of earlier
versions), only regular files of the user's in a folder checked to be the user's, and only
those no writer holds locked: two jobs (two notebooks) may share a folder, and the second
one's start must not remove the file the first is writing. The unsigned checkpoints of
earlier versions (``checkpoint.em`` starting ``EMCKPT01``, the pair ``snapshot.pt`` +
``snapshot.json``) are refused, saying so.

In memory, a snapshot is a memory file the committing ranks wrote it into (``parts``: the
agent's own, reused from commit to commit), a checkpoint was read into, or a worker wrote
and offered; bytes only where no file could be shared. Workers read it back through /proc.
``StateServer`` answers the ranks' requests from it.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ...folders import READ_FILE, NotPrivate, describe
from ...training.checkpoint_key import checkpoint_key
from ...wire.events import Committed
from ...wire.messages import (
    Commit,
    CommitIntent,
    CommitReply,
    CommitTarget,
    Handoff,
    Reply,
    StateGet,
    StateReply,
    StateRequest,
)
from . import checkpoint_file
from .checkpoint_folder import FILE as _FILE
from .checkpoint_folder import CheckpointFolder, temporary_file
from .commit_files import CommitFiles

_LEGACY_DATA, _LEGACY_META = "snapshot.pt", "snapshot.json"  # earlier versions' pair
split_checkpoint = checkpoint_file.split


@dataclass
class SnapshotStore:
    """The agent's latest committed snapshot, with its metadata: kept in memory, loaded from
    and written behind to the checkpoint folder when there is one."""

    directory: Path | None = None
    commit_id: int = 0
    meta: dict[str, Any] | None = None
    _bytes: bytes | None = None
    _fd: int | None = None  # an anonymous memory file this store owns
    size: int = 0
    _writer: CheckpointWriter | None = field(default=None, repr=False)
    trust_path: bool = False  # --checkpoint-shared
    moved: bool = False  # --checkpoint-moved
    _place: CheckpointFolder | None = None  # the checkpoint folder, checked
    _key: bytes | None = None  # the user's checkpoint key (signs and checks checkpoints)
    parts: CommitFiles = field(default_factory=CommitFiles)  # the files commits go into
    token: int = 0  # the commit's (rank 0's random number): its chunks on other machines
    # the folder held a checkpoint once, and holds none now: (its counter, when)
    vanished: tuple[int, float] | None = None
    moved_past: str | None = None  # why the checkpoint was refused but for --checkpoint-moved

    @property
    def blob(self) -> bytes | None:
        """The snapshot as bytes (a copy when it lives in a memory file)."""
        if self._fd is None:
            return self._bytes
        return os.pread(self._fd, self.size, 0)

    @property
    def source(self) -> bytes | int | None:
        """The snapshot: bytes, or the descriptor of the memory file holding it."""
        return self._fd if self._fd is not None else self._bytes

    @property
    def memory_file(self) -> int | None:
        """The descriptor of the memory file holding the snapshot, if it is in one."""
        return self._fd

    def load_checkpoint(self) -> bool:
        """Take the snapshot a previous run left in the directory, if any, once its
        signature proves the user's key wrote it. Raises NotPrivate, loading nothing, where
        the folder, a file or the key is not safely the user's, or the checkpoint is not
        signed with that key (CheckpointRefused)."""
        if self.directory is None:
            return False
        folder = self._folder()
        path = folder.path / _FILE
        try:
            file = self._open(folder.fd, _FILE)
        except FileNotFoundError:
            self._checkpoint_key()  # a bad key file is refused before anything starts
            try:
                with self._open(folder.fd, _LEGACY_META), self._open(folder.fd, _LEGACY_DATA):
                    pass
            except FileNotFoundError:
                self.vanished = folder.vanished()
                return False
            raise checkpoint_file.CheckpointRefused(
                f"the checkpoint {folder.path / _LEGACY_DATA} was written by an earlier "
                "version of elastic_magic, without a signature: it is not loaded (loading "
                "it runs whatever it holds). Move it away to start from scratch; see "
                "the Security page of the docs, docs/explanation/security.md.") from None
        with file:  # a signed one there: a missing key is an error, never a new key
            signed = file.read(len(checkpoint_file.MAGIC)) == checkpoint_file.MAGIC
            file.seek(0)
            key = self._checkpoint_key(signed=path if signed else None)
            meta, fd = checkpoint_file.load(file, path, key)
        try:  # the latest this folder held, here; or what --checkpoint-moved overlooked
            self.moved_past = folder.check(meta.pop("folder", None))
        except BaseException:
            os.close(fd)
            raise
        self.meta, self.token = meta, 0
        self._replace(fd=fd)
        return True

    def _checkpoint_key(self, signed: Path | None = None) -> bytes:
        if self._key is None:
            self._key = checkpoint_key(signed=signed)
        return self._key

    def _folder(self) -> CheckpointFolder:
        if self._place is None:
            assert self.directory is not None
            self._place = CheckpointFolder(self.directory, trust_path=self.trust_path,
                                           moved=self.moved)
        return self._place

    def _open(self, folder: int, name: str) -> BinaryIO:
        """A file of the checkpoint, open, if it is the user's own and no one else may
        write it."""
        path = self.directory / name if self.directory else Path(name)
        try:
            fd = os.open(name, READ_FILE, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotPrivate(f"the checkpoint {path} is a symbolic link: it is not "
                                 "loaded. Remove it if you did not put it there.") from None
            raise
        file = open(fd, "rb")  # noqa: SIM115 (the caller's)
        info = os.fstat(fd)
        problem = describe(info, path, private=False) if stat.S_ISREG(info.st_mode) \
            else f"{path} is not a file"
        if problem:
            file.close()
            raise NotPrivate(f"the checkpoint is not loaded: {problem}. Someone else may "
                             "have planted it to run code in your job: remove it, or give "
                             "another --checkpoint-dir.")
        return file

    def commit(self, meta: dict[str, Any], *, data: bytes | None = None,
               fd: int | None = None, token: int = 0) -> None:
        """Keep a new snapshot: ``data``, or the memory file ``fd`` (the store owns it)."""
        self._replace(data=data, fd=fd)
        self.meta, self.token = meta, token
        self.commit_id += 1
        if self.directory is not None:
            if self._writer is None:
                self._writer = CheckpointWriter(self._folder(), self._checkpoint_key())
            self._writer.submit(meta, data if fd is None else os.dup(fd), self.size)

    def close(self) -> None:
        """Release the snapshot, once the checkpoint (if any) is on disk."""
        self.parts.close()
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            self._replace()
            if self._place is not None:
                self._place.close()
                self._place = None

    def _replace(self, data: bytes | None = None, fd: int | None = None) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._bytes, self._fd = data, fd
        self.size = os.fstat(fd).st_size if fd is not None else len(data or b"")


def _write_atomically(place: CheckpointFolder, name: str, key: bytes, meta: dict[str, Any],
                      source: bytes | int | None, size: int = 0) -> None:
    """Write the signed checkpoint of ``source`` (bytes, or ``size`` bytes of a file
    descriptor), sealed as the folder's next, to a new temporary file in the folder, fsync
    it, then rename it over ``name``."""
    with place.sealing() as seal, temporary_file(place.fd, name) as (fd, tmp):
        checkpoint_file.write(fd, key, {**meta, "folder": seal}, source, size)
        os.fsync(fd)
        os.replace(tmp, name, src_dir_fd=place.fd, dst_dir_fd=place.fd)


class CheckpointWriter:
    """Writes the newest submitted snapshot to the checkpoint folder on its own thread;
    one that is superseded before its turn is skipped. An error is raised by the next
    ``submit`` or by ``close``."""

    def __init__(self, folder: CheckpointFolder, key: bytes) -> None:
        self.folder = folder  # the store's
        self.key = key
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
                _write_atomically(self.folder, _FILE, self.key, meta, source, size)
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

    def get(self, inline: bool, held: int = 0) -> StateReply:
        store = self.store
        if self.held_by_rank(held):  # it rolls back from its memory: nothing to send
            return StateReply(store.commit_id, token=store.token)
        if store.memory_file is not None and not inline:  # read through /proc (or inline)
            return StateReply(store.commit_id, handoff=Handoff.of(store.memory_file),
                              token=store.token)
        return StateReply(store.commit_id, snapshot=store.blob, token=store.token)

    def held_by_rank(self, held: int) -> bool:
        """The latest commit is the one a rank holds in memory (``StateGet.held``)."""
        return held != 0 and held == self.store.token

    def target(self, request: CommitTarget, inline: bool) -> CommitReply:
        """Where a rank writes its part of a commit: our memory file for it (a rank of
        another machine keeps its part there, and sends it)."""
        if inline:
            return CommitReply()
        return CommitReply(target=Handoff.of(self.store.parts.target(request.token,
                                                                     request.sizes)))

    def commit(self, request: Commit, world_size: int,
               memory_file: int | None = None) -> CommitReply:
        """Keep the snapshot, or the part of one: written into our file for it, or in the
        request (bytes, or ``memory_file``, which is then ours)."""
        source = memory_file if memory_file is not None else request.snapshot
        if request.sizes:
            if len(request.sizes) != (world_size if request.parts > 1 else 1):
                if memory_file is not None:
                    os.close(memory_file)
                return CommitReply(error=f"the commit was not kept: {request.parts} parts "
                                         f"for {world_size} ranks")
            try:
                fd = self.store.parts.add(request.part, request.token, request.sizes,
                                          None if request.written else source or b"")
            except (OSError, ValueError) as exc:
                return CommitReply(error=f"the commit was not kept: {exc}")
            if fd is None:
                return CommitReply()  # the other parts are still to come
            source = fd
        meta = {"step": request.step, "time": request.time, "world_size": world_size}
        if isinstance(source, int):
            self.store.commit(meta, fd=source, token=request.token)
        else:
            self.store.commit(meta, data=source, token=request.token)
        self.emit(Committed(request.step, world_size, self.store.size,
                            samples=request.samples))
        return CommitReply()

    def serve(self, request: StateRequest, world_size: int, *, inline: bool) -> Reply:
        """A request whose snapshot, if any, came as bytes (another machine's rank)."""
        match request:
            case StateGet():
                return Reply(request.request_id, self.get(inline or request.inline, request.held))
            case Commit():
                return Reply(request.request_id, self.commit(request, world_size))
            case CommitTarget():
                return Reply(request.request_id, self.target(request, inline))
            case CommitIntent():  # every rank leaves at this commit: a resize, machines wait
                return Reply(request.request_id, CommitReply(resize=self.leave_at_commit()))
            case other:
                raise TypeError(f"not a State request: {other!r}")
