"""The checkpoint folder as a job holds it: opened once, on descriptors, through folders and
links no one else could have changed (``folders.own_path``); its id; the seal of each
checkpoint written there, and the check that the one found there is the latest it held.

A checkpoint signed with the user's key may still be an older one of the user's: whoever can
write a folder on the way (a team's folder, with --checkpoint-shared) can rename the
folder away and put another of the user's at its name, and a job would resume from its older
checkpoint and write over it. So each checkpoint's signed header carries a seal: the
folder's id (random, kept in the folder's ``checkpoint-folder.id``), the folder's path, and a
counter that grows with each checkpoint the folder holds. This machine's record
(``checkpoint_ledger``, beside the key) keeps each folder's last counter and the folder each
path last held. A checkpoint is loaded only if its seal names this folder, at this path, the
one the path last held, with a counter no older than the last recorded; --checkpoint-moved
takes it all the same (the user moved the folder, or put an older copy back), and records
it as the folder's latest.

Writers of one folder (two jobs sharing it) take turns on a lock of its id file, so the
counters reach the folder, and the record, in the order they grow.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...folders import READ_FILE, NotPrivate, SharedFolder, describe, new_file, own_path
from ...training import checkpoint_ledger
from . import checkpoint_file

FILE = "checkpoint.em"  # signed: checkpoint_file
ID_FILE = "checkpoint-folder.id"
_LEFTOVER = re.compile(r"\.(checkpoint\.em|snapshot\.pt|snapshot\.json|checkpoint-folder\.id)"
                       r"\.[0-9a-f]{16}")
_ID = re.compile(rb"[0-9a-f]{32}")
MOVED = "--checkpoint-moved (checkpoint_moved=True in Python)"


class CheckpointFolder:
    """A --checkpoint-dir, open and checked; ``close`` releases it."""

    def __init__(self, path: Path, *, trust_path: bool = False, moved: bool = False) -> None:
        try:
            self.fd, self.path = own_path(path, create=True, trust_writers=trust_path)
        except NotPrivate as exc:
            trust = " (or add --checkpoint-shared if you trust everyone who can write " \
                "the folders on the way)" if isinstance(exc, SharedFolder) else ""
            raise NotPrivate(f"--checkpoint-dir {path}: {exc}: nothing is loaded from it or "
                             f"written to it. Give a folder that only you can write{trust}.") \
                from None
        self.moved = moved
        try:
            self._id_fd, self.id = _folder_id(self.fd, self.path)
            _remove_leftovers(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self._id_fd)
        os.close(self.fd)

    @contextlib.contextmanager
    def sealing(self) -> Iterator[dict[str, Any]]:
        """The seal of the next checkpoint written here, while the folder's other writers
        wait; recorded as the folder's latest once the block has put it in place."""
        fcntl.flock(self._id_fd, fcntl.LOCK_EX)
        try:
            last, _ = checkpoint_ledger.lookup(self.id, self.path)
            # The one in the folder counts too: another machine (its own record) wrote it.
            counter = max(last or 0, _counter(self._held())) + 1
            yield {"id": self.id, "path": str(self.path), "counter": counter}
            checkpoint_ledger.record(self.id, self.path, counter)
        finally:
            fcntl.flock(self._id_fd, fcntl.LOCK_UN)

    def check(self, seal: Any) -> str | None:
        """Raise CheckpointRefused, saying what to do, unless the checkpoint sealed with
        ``seal`` is the latest this folder held, here; with --checkpoint-moved, record it
        as the latest instead and return what it overlooked."""
        problem = self._problem(seal)
        if problem is None:
            return None
        if not self.moved:
            if _counter(seal) == 0:
                advice = (f"If it is this folder's latest checkpoint, resume from it once with "
                          f"{MOVED} (the next one is tied to the folder); otherwise move it "
                          "away to start from scratch")
            else:
                advice = (f"If you did that yourself, resume with {MOVED}; otherwise do not "
                          "resume here (a job would write over this folder's checkpoint)")
                if "older than" not in problem:
                    advice += ": find where your folder went, with its latest checkpoint"
            raise checkpoint_file.CheckpointRefused(
                f"the checkpoint {self.path / FILE} is not loaded: {problem}. {advice}. See "
                "the Security page of the docs, docs/explanation/security.md.")
        checkpoint_ledger.record(self.id, self.path, _counter(seal), reset=True)
        return problem

    def vanished(self) -> tuple[int, float] | None:
        """For a folder that holds no checkpoint: the counter and time of the last one this
        machine's record says was written here (a folder renamed away and an empty one put
        in its place, or the checkpoint removed), to be told before the job starts from
        scratch; None if none was."""
        return checkpoint_ledger.last_written_at(self.path)

    def _problem(self, seal: Any) -> str | None:
        if _counter(seal) == 0:
            return ("it was written by an earlier version of elastic_magic, which did not tie "
                    "a checkpoint to its folder: it cannot be told from an older checkpoint "
                    "of yours put in this folder's place")
        if seal["id"] != self.id:
            return (f"it was written in another folder (then at {seal['path']}) and copied "
                    "or moved into this one")
        if seal["path"] != str(self.path):
            return (f"its folder was at {seal['path']} when it was written: it has been "
                    "moved or renamed since, by you or by someone who can write a folder on "
                    "the way, putting one of your folders in another's place")
        last, at_path = checkpoint_ledger.lookup(self.id, self.path)
        if at_path not in (None, self.id):
            return (f"{self.path} held another folder of yours when a checkpoint was last "
                    "written there: this one was put in its place since, by you or by "
                    "someone who can write a folder on the way")
        if last is not None and seal["counter"] < last:
            return (f"it is older than the last checkpoint this folder held (it is its "
                    f"checkpoint {seal['counter']}, and {last} was written since): an older "
                    "copy was put back in its place")
        return None

    def _held(self) -> Any:
        """The seal of the checkpoint the folder holds, unchecked (a floor for the next
        counter, in a folder only the user can write); None if there is none."""
        try:
            fd = os.open(FILE, READ_FILE | os.O_NONBLOCK, dir_fd=self.fd)
        except OSError:
            return None
        with open(fd, "rb") as file:
            return checkpoint_file.peek(file).get("folder")


def _counter(seal: Any) -> int:
    """A seal's counter; 0 for one that is not a seal (none: an earlier version's)."""
    ok = isinstance(seal, dict) and isinstance(seal.get("id"), str) \
        and isinstance(seal.get("path"), str) and isinstance(seal.get("counter"), int)
    return seal["counter"] if ok else 0


# Where a file system has no hard links (gcsfuse, s3fs, SMB mounts, some FUSE): the id is
# written in place instead, and a reader that meets it half written waits for the rest.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK)
_ID_WRITE_WAIT = 2.0  # seconds: a writer of 32 bytes is done long before


def _new_id(folder: int) -> None:
    """Put a new id in the folder unless another job put one first: written whole under a
    temporary name, then linked (of two jobs, one wins); written in place where the file
    system cannot link."""
    with temporary_file(folder, ID_FILE) as (tmp_fd, tmp):
        os.write(tmp_fd, secrets.token_hex(16).encode())
        os.fsync(tmp_fd)
        try:
            os.link(tmp, ID_FILE, src_dir_fd=folder, dst_dir_fd=folder)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            with contextlib.suppress(FileExistsError):
                fd = new_file(folder, ID_FILE)
                try:
                    os.write(fd, secrets.token_hex(16).encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
        os.unlink(tmp, dir_fd=folder)


def _read_id(fd: int) -> bytes:
    """The id file's text; one written in place by another job (no hard links) may be
    met before its 32 bytes are all there: wait for them a moment."""
    deadline = time.monotonic() + _ID_WRITE_WAIT
    while True:
        text = os.pread(fd, 64, 0)
        if len(text) >= 32 or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def _folder_id(folder: int, path: Path) -> tuple[int, str]:
    """The folder's id file, open (writers lock it), and the id it holds (``_new_id``
    makes one where there is none)."""
    where = path / ID_FILE
    while True:
        try:
            fd = os.open(ID_FILE, READ_FILE | os.O_NONBLOCK, dir_fd=folder)
            break
        except FileNotFoundError:
            _new_id(folder)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise NotPrivate(f"{where} is a symbolic link: nothing is loaded from "
                             f"--checkpoint-dir {path}. Remove it.") from None
    info = os.fstat(fd)
    problem = describe(info, where, private=False) if stat.S_ISREG(info.st_mode) \
        else f"{where} is not a file"
    text = _read_id(fd) if not problem else b""
    if problem or not _ID.fullmatch(text):
        os.close(fd)
        raise NotPrivate(f"--checkpoint-dir {path}: {problem or f'{where} is not an id'}: "
                         "nothing is loaded from it. Remove it if you did not put it there.")
    return fd, text.decode()


def _remove_leftovers(folder: int) -> None:
    """Remove the temporary files of checkpoint writes that a crash interrupted: regular
    files of the user's, named as this module names them, in a folder checked to be the
    user's (no one else can have put or renamed anything there), that no writer holds
    locked: another job sharing the folder may be writing one (``temporary_file``)."""
    for name in os.listdir(folder):
        if not _LEFTOVER.fullmatch(name):
            continue
        try:  # O_NONBLOCK: a FIFO must not stall the job's start
            fd = os.open(name, READ_FILE | os.O_NONBLOCK, dir_fd=folder)
        except OSError:
            continue  # gone already, or a link: left alone
        try:
            info = os.fstat(fd)
            if not (stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a write under way
            with contextlib.suppress(FileNotFoundError):
                now = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino):
                    os.unlink(name, dir_fd=folder)
        finally:
            os.close(fd)


@contextlib.contextmanager
def temporary_file(folder: int, name: str) -> Iterator[tuple[int, str]]:
    """A new temporary file for ``name`` in ``folder`` (a descriptor), open for writing
    and locked (``flock``) while the block runs: its descriptor and its name. Removed if
    the block raises."""
    while True:
        tmp = f".{name}.{secrets.token_hex(8)}"
        fd = new_file(folder, tmp)
        # Held until the file is renamed or removed: another job starting on the folder
        # removes only the temporary files no one holds (``_remove_leftovers``).
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:
            break
        os.close(fd)  # removed between its creation and the lock: take another
    try:
        yield fd, tmp
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)
        raise
    finally:
        os.close(fd)
