"""Folders a job writes into (logs, checkpoints) and the files it makes there, on a machine
that other users share.

Whoever can write to a folder can plant things in it before the job writes there: a folder
of theirs (they read the output), a link to a file of the victim's (the job truncates it),
a checkpoint (loading it unpickles it: their code runs in the job). Hence: folders a job
creates are 0700; a folder that exists already is opened without following a link and
checked on its descriptor (owner, mode); files are created with ``O_EXCL | O_NOFOLLOW``
relative to a folder descriptor the job holds, so renaming the folder and planting another
at its name (possible wherever others can write its parent) redirects nothing.

A folder whose files a job loads (--checkpoint-dir, the key's) is reached from / one folder
at a time (``open_path``): a folder on the way that lets others rename what it holds, or a
link that someone else could have made, would let them choose which folder of the user's
the job loads from and writes over.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import stat
import tempfile
from pathlib import Path

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# A folder on the way, opened only to go through it (search permission: a parent such as a
# /scratch at mode 0711 cannot be listed); fstat and the *at calls take such a descriptor.
PASS_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


MAX_LINKS = 40  # links followed in one path, as the kernel's own limit


class NotPrivate(Exception):
    """A folder or file a job would use is not safely the user's own. The message says
    what to do."""


class SharedFolder(NotPrivate):
    """A folder on the way to a path is another user's, or others can write it without the
    sticky bit: they could put another folder at the path. The user may trust them."""


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


def private_file_problem(fd: int, path: Path) -> str | None:
    """Why the open file ``fd`` (at ``path``) is not a regular file of the user's that no
    one else may read or write; None when it is one."""
    info = os.fstat(fd)
    return describe(info, path, private=True) if stat.S_ISREG(info.st_mode) \
        else f"{path} is not a file"


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


def _trusted(uid: int) -> bool:
    return uid in (0, os.geteuid())


def replaceable(info: os.stat_result) -> str | None:
    """Who, besides the user and root, can rename or replace what the folder with ``info``
    holds, in words; None where no one can. A sticky folder of root's or the user's (/tmp)
    lets others replace only what is theirs."""
    if not _trusted(info.st_uid):
        return f"belongs to user id {info.st_uid}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        return f"can be written by other users (mode {mode:o}, without the sticky bit)"
    return None


def open_path(path: Path, *, create: bool = False, trust_writers: bool = False
              ) -> tuple[int, Path]:
    """A descriptor of the folder ``path`` (absolute) and where it really is, reached from
    / one folder at a time, each opened relative to the one before (what a name holds
    cannot change between its check and its use); the missing part created 0700
    (``create``). Raises SharedFolder where a folder on the way lets others replace what
    it holds (``replaceable``), unless ``trust_writers``; NotPrivate for a link that
    someone else could have made (another user's, or in such a folder), never followed,
    and for a file on the way; OSError as opening a folder does."""
    pending = list(reversed(path.parts))
    fd = os.open("/", PASS_DIR)
    real: list[str] = []
    links = 0
    try:
        while pending:
            name = pending.pop()
            if name.startswith("/"):  # an absolute path or link target: from the top
                fd = _instead(fd, os.open("/", PASS_DIR))
                real.clear()
                continue
            if name in ("", "."):
                continue
            if name == "..":
                fd = _instead(fd, os.open("..", PASS_DIR, dir_fd=fd))
                del real[-1:]
                continue
            here = Path("/", *real)
            writers = replaceable(os.fstat(fd))
            if writers and not trust_writers:
                _refuse_link(fd, name, here, writers)  # named as such, if it is one
                fix = f" (`chmod go-w {here}` if no one else needs to write there; if " \
                    f"others do, `chmod +t {here}` lets them replace only what is theirs)" \
                    if os.fstat(fd).st_uid == os.geteuid() else ""
                raise SharedFolder(f"the folder {here} on the way {writers}: whoever can "
                                   f"write it can put another folder, or a link to one, at "
                                   f"{here / name}{fix}")
            try:
                child = _open_child(fd, name, create)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                target = _refuse_link(fd, name, here, writers)
                if target is None:
                    raise NotPrivate(f"{here / name} is not a folder") from None
                links += 1
                if links > MAX_LINKS:
                    raise NotPrivate(f"{path}: more than {MAX_LINKS} symbolic links on the "
                                     "way") from None
                pending.extend(reversed(Path(target).parts))
                continue
            fd = _instead(fd, child)
            real.append(name)
        # The folder reached, opened for use (listing, locks) as the very one walked to.
        return _instead(fd, os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECTORY
                                    | os.O_CLOEXEC)), Path("/", *real)
    except BaseException:
        os.close(fd)
        raise


def own_path(path: Path, *, create: bool = False, trust_writers: bool = False,
             private: bool = False) -> tuple[int, Path]:
    """``open_path``, and the folder it ends at checked on its descriptor: the user's, and
    no one else may write to it (``private``, for secrets such as a job's token: nor read
    it)."""
    fd, real = open_path(path, create=create, trust_writers=trust_writers)
    problem = describe(os.fstat(fd), real, private=private)
    if problem:
        os.close(fd)
        raise NotPrivate(f"{problem}; it must be a folder of yours alone (chmod 700)"
                         if private else problem)
    return fd, real


def cache_folder() -> Path | None:
    """``$XDG_CACHE_HOME/elastic_magic`` (``~/.cache/elastic_magic``); None without a home."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):  # the XDG rule: a relative path is ignored
        with contextlib.suppress(RuntimeError):  # no home directory
            cache = str(Path.home() / ".cache")
    return Path(cache) / "elastic_magic" if os.path.isabs(cache) else None


def token_folder() -> Path:
    """Where a job's token files go (the join's ``--token-file``): a private folder under
    the user's home, which a cluster's machines usually share."""
    cache = cache_folder()
    return cache / "tokens" if cache else Path(tempfile.gettempdir(),
                                               f"elastic_magic-{os.getuid()}", "tokens")


def absolute(path: Path) -> Path:
    """``path`` from the current folder, its links and ``..`` left for ``open_path``."""
    path = path.expanduser()
    return path if path.is_absolute() else Path(os.getcwd(), path)


def _refuse_link(fd: int, name: str, here: Path, writers: str | None) -> str | None:
    """Where the link ``name`` in the folder ``fd`` (``here``) points, if it is one that
    only the user or root can have made; None if it is not a link. Raises NotPrivate
    for another user's link, or one in a folder that ``writers`` (others) can write."""
    try:
        info = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(info.st_mode):
        return None
    target = os.readlink(name, dir_fd=fd)
    link = f"{here / name} is a symbolic link (to {target})"
    if not _trusted(info.st_uid):
        raise NotPrivate(f"{link} that user id {info.st_uid} made, not you: it is not "
                         "followed")
    if writers:
        raise NotPrivate(f"{link} in {here}, which {writers}: any of them could have made "
                         "it, or changed where it points; it is not followed")
    return target


def _instead(old: int, new: int) -> int:
    os.close(old)
    return new


def _open_child(fd: int, name: str, create: bool) -> int:
    try:
        return os.open(name, PASS_DIR, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    with contextlib.suppress(FileExistsError):  # one made meanwhile is opened as any other
        os.mkdir(name, 0o700, dir_fd=fd)
    return os.open(name, PASS_DIR, dir_fd=fd)


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
