"""Folders a job writes into (logs, checkpoints) and the files it makes there, on a machine
that other users share.

Whoever can write to a folder can plant things in it before the job writes there: a folder
of theirs (they read the output), a link to a file of the victim's (the job truncates it),
a checkpoint (loading it unpickles it: their code runs in the job). Hence: folders a job
creates are 0700; a folder that exists already is opened without following a link and
checked on its descriptor (owner, mode); files are created with ``O_EXCL | O_NOFOLLOW``
relative to a folder descriptor the job holds, so renaming the folder and planting another
at its name (possible wherever others can write its parent) redirects nothing.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
from pathlib import Path

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotPrivate(Exception):
    """A folder or file a job would use is not safely the user's own. The message says
    what to do."""


def make_folders(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 (the umask can only take bits
    away): a folder a job creates is its user's alone."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        # One made meanwhile is checked where it matters, by whoever opens it.
        with contextlib.suppress(FileExistsError):
            folder.mkdir(mode=0o700)


def describe(info: os.stat_result, path: Path, *, private: bool) -> str | None:
    """What makes a folder (or file) with ``info`` unsafe for the user: another's, or
    writable (``private``: also readable) by others; None if it is safe."""
    me = os.geteuid()
    if info.st_uid != me:
        return (f"{path} belongs to user id {info.st_uid}, not to you (uid {me}): its owner "
                f"chooses what it holds")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (0o077 if private else 0o022):
        return f"{path} is open to other users (mode {mode:o})"
    return None


def open_folder(path: Path | str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``path`` (relative to ``dir_fd``), its last component
    not followed if it is a link. Raises NotPrivate for a link or a non-folder."""
    try:
        return os.open(path, OPEN_DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivate(f"{path} is a symbolic link or not a folder") from None
        raise


def own_folder(path: Path, *, private: bool) -> int:
    """A descriptor of the existing folder ``path``, checked on that descriptor: the
    user's, closed to writes (``private``: to everything) from others."""
    fd = open_folder(path)
    problem = describe(os.fstat(fd), path, private=private)
    if problem:
        os.close(fd)
        raise NotPrivate(problem)
    return fd


def subfolder(dir_fd: int, name: str) -> int:
    """A descriptor of ``name`` in the folder ``dir_fd``, created 0700 if missing. Only for
    a folder checked private: what it holds already is then the user's own."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    return open_folder(name, dir_fd=dir_fd)


def new_file(dir_fd: int, name: str) -> int:
    """Create ``name`` in the folder ``dir_fd``, 0600, for writing: never an existing file
    and never through a link."""
    return os.open(name, NEW_FILE, 0o600, dir_fd=dir_fd)


def redirectable(path: Path) -> bool:
    """Whether someone other than the user (or root) could make ``path`` name another
    folder, by renaming a component in a parent they can write. A sticky parent (/tmp)
    lets only a component's owner, or the parent's, rename it."""
    trusted = (0, os.geteuid())
    parts = [path, *path.parents]
    for child, parent in itertools.pairwise(parts):
        try:
            child_info, info = os.lstat(child), os.stat(parent)
        except OSError:
            return True
        if info.st_uid not in trusted:
            return True
        if info.st_mode & 0o022 and not (info.st_mode & stat.S_ISVTX
                                         and child_info.st_uid in trusted):
            return True
    return False
