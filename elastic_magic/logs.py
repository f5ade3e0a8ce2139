"""Where per-rank logs live: ``<log_dir>/<run_id>/group_<n>/rank_<r>/{stdout,stderr}.log``.
One place for the layout. ``n`` counts the job's worker groups from 0: a restart and a
resize each start a new group (so it is not a count of restarts; the functions below call it
``attempt``, as torch's agent does).

Logs hold all the ranks print, so they are private: the folders a job creates are 0700 and
its log files 0600, whatever the umask. A --log-dir may be a folder others can write (a
project's shared folder): each run's folder in it is created new by the job, held open, and
everything below it is made through that descriptor, never through a link (``RunFolder``,
``folders.py``). Without --log-dir they go to a folder of the user's
own, ``$XDG_CACHE_HOME/elastic_magic/logs`` (``~/.cache/elastic_magic/logs``), or, where
that cannot be created, ``<temp dir>/elastic_magic-<uid>/logs``; the ``elastic_magic``
folder is checked first (not a link, owned by the user, closed to others), because whoever
created it could read every job's output. That default folder is pruned as each job
starts: only the newest ``KEEP_RUNS`` runs, and of those only the ones from the last
``KEEP_DAYS`` days, are kept. A run that a job still writes is never removed (the job holds
a lock on its folder, see ``RunFolder``). A folder given with --log-dir is never pruned;
``prune(folder)`` does it on request.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from .folders import (
    NotPrivate,
    cache_folder,
    describe,
    make_folders,
    new_file,
    own_folder,
    redirectable,
    subfolder,
)

KEEP_RUNS = 50
KEEP_DAYS = 7.0
RUN_PREFIX = "em-"  # run ids are em-<hex>; nothing else in a log folder is ever removed


GROUP_PREFIX = "group_"


def rank_dir(job_logs: Path, attempt: int, rank: int) -> Path:
    return job_logs / f"{GROUP_PREFIX}{attempt}" / f"rank_{rank}"


def latest_attempt(job_logs: Path) -> int | None:
    numbers = [int(p.name.removeprefix(GROUP_PREFIX)) for p in job_logs.glob(f"{GROUP_PREFIX}*")]
    return max(numbers, default=None)


def rank_log(job_logs: Path, rank: int, stream: str = "stdout",
             attempt: int | None = None) -> Path | None:
    """One rank's log file, of the latest attempt by default; None if there is none."""
    attempt = latest_attempt(job_logs) if attempt is None else attempt
    if attempt is None:
        return None
    return rank_dir(job_logs, attempt, rank) / f"{stream}.log"


# -- a run's folder, held open --------------------------------------------------------------

class RunFolder:
    """A run's log folder, held open while the job runs (with a shared lock, so that
    ``prune``, in this kernel or another, leaves it alone). Everything below it is made
    relative to that descriptor: a folder others can write (a shared --log-dir) lets them
    rename the run's folder and plant their own at its name, and that must redirect no
    output. ``close`` releases it; so does the process's death."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path  # as the user sees it
        self.fd = fd
        # What workers are told to write to (TORCHELASTIC_ERROR_FILE): the path, unless
        # others could make it name another folder; then this descriptor, through /proc.
        proc = Path(f"/proc/{os.getpid()}/fd/{fd}")
        self.reach = proc if redirectable(path) and proc.is_dir() else path

    @classmethod
    def open(cls, path: Path, *, fresh: bool = True) -> RunFolder:
        """Create the run's folder ``path`` (0700) and hold it. ``fresh``: it must not
        exist (its run id is new: a folder there is not this job's). Otherwise another
        machine of this job on this host may have made it: it is used if it is ours and
        private, checked on its descriptor."""
        instead = ("Give a log folder that only you can write with --log-dir DIR "
                   "(log_dir=... in Python)")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if fresh:
                raise NotPrivate(
                    f"the run's log folder {path} exists already, and this job did not "
                    f"create it: someone who can write to {path.parent} may have planted it "
                    f"to read the job's output. {instead}.") from None
        try:
            fd = own_folder(path, private=True)
        except NotPrivate as exc:
            raise NotPrivate(
                f"the run's log folder is not this job's: {exc}; someone who can write to "
                f"{path.parent} may have planted it to read the job's output. Remove it if "
                f"it is yours to remove. {instead}.") from None
        fcntl.flock(fd, fcntl.LOCK_SH)  # shared: machines of one job on one host hold it
        return cls(path, fd)

    def rank_dir(self, attempt: int, rank: int) -> Path:
        """A rank's folder as the user sees it."""
        return rank_dir(self.path, attempt, rank)

    def error_file(self, attempt: int, rank: int) -> Path:
        return rank_dir(self.reach, attempt, rank) / "error.json"

    def create_logs(self, attempt: int, rank: int,
                    streams: tuple[str, ...] = ("stdout", "stderr")) -> dict[str, int]:
        """Make a rank's folder and create its log files (0600, new, never through a
        link): descriptors open for writing, by stream."""
        group = subfolder(self.fd, f"{GROUP_PREFIX}{attempt}")
        try:
            folder = subfolder(group, f"rank_{rank}")
        finally:
            os.close(group)
        logs: dict[str, int] = {}
        try:
            for stream in streams:
                logs[stream] = _create_log(folder, f"{stream}.log")
        except BaseException:
            for fd in logs.values():
                os.close(fd)
            raise
        finally:
            os.close(folder)
        return logs

    def where(self) -> Path:
        """Where the run's folder is now: another user who can write to its parent may
        have renamed it (and planted hers at its name)."""
        with contextlib.suppress(OSError):
            now = Path(os.readlink(f"/proc/self/fd/{self.fd}"))
            if now != self.path and now.is_dir() and os.path.samestat(
                    os.stat(now), os.fstat(self.fd)):
                return now
        return self.path

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _create_log(folder: int, name: str) -> int:
    try:
        return new_file(folder, name)
    except FileExistsError:
        # Another machine of this job on this host (attempts count per machine) had a
        # group with this number and rank: its log is kept beside ours. The folder is
        # private, so the file is the user's own.
        os.rename(name, f"{name}.{time.time_ns()}", src_dir_fd=folder, dst_dir_fd=folder)
        return new_file(folder, name)


# -- the default folder -------------------------------------------------------------------

def default_roots() -> list[Path]:
    """The folders that may hold the default log folder, in order of preference."""
    roots = []
    cache = cache_folder()
    if cache is not None:
        roots.append(cache)
    roots.append(Path(tempfile.gettempdir()) / f"elastic_magic-{os.getuid()}")
    return roots


def default_log_dir() -> Path:
    """The default log folder, created if need be, in the first root that can hold it.
    Raises NotPrivate where a root exists but is not private, OSError where none can be
    created."""
    error: OSError | None = None
    for root in default_roots():
        try:
            private_folder(root)
        except NotPrivate:
            raise
        except OSError as exc:  # a home that is read-only or missing: the next root
            error = exc
            continue
        logs = root / "logs"
        with contextlib.suppress(FileExistsError):
            logs.mkdir(mode=0o700)
        return logs
    assert error is not None
    raise error


def is_default(log_dir: Path) -> bool:
    """Whether ``log_dir`` is the default folder (or one it could be): the one pruned."""
    return any(log_dir == root / "logs" for root in default_roots())


def private_folder(path: Path) -> None:
    """Create ``path`` 0700, or check the one there: a folder, not a link, of this user,
    closed to group and others. Raises NotPrivate saying what to do."""
    make_folders(path.parent)
    try:
        path.mkdir(mode=0o700)
        return
    except FileExistsError:
        pass
    info = os.lstat(path)  # a link planted there is not followed
    instead = "or give a log folder of your own with --log-dir DIR (log_dir=... in Python)"
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise NotPrivate(f"the default log folder {path} is {kind}. Remove it if it is yours "
                         f"to remove, {instead}.")
    problem = describe(info, path, private=True)  # whoever can read it reads every job's output
    if problem:
        fix = f"Run `chmod 700 {path}`" if info.st_uid == os.geteuid() \
            else "Ask its owner or an administrator to remove it"
        raise NotPrivate(f"the default log folder {problem}. {fix}, {instead}.")


# -- pruning ------------------------------------------------------------------------------

def prune(folder: Path, keep: int = KEEP_RUNS, days: float = KEEP_DAYS) -> list[Path]:
    """Remove runs from ``folder`` beyond the ``keep`` newest, and runs older than
    ``days`` (by when their folder last changed: a run's last attempt started). A run
    that a job still writes is kept; so is anything not named like a run. Returns the
    runs removed."""
    runs = []
    with os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):  # pruned by another kernel
                if entry.name.startswith(RUN_PREFIX) and entry.is_dir(follow_symlinks=False):
                    runs.append((entry.stat(follow_symlinks=False).st_mtime,
                                 Path(entry.path)))
    runs.sort(reverse=True)
    oldest_kept = time.time() - days * 24 * 3600
    removed = []
    for index, (changed, run) in enumerate(runs):
        if (index >= keep or changed < oldest_kept) and _remove_finished(run):
            removed.append(run)
    return removed


def _remove_finished(run: Path) -> bool:
    try:
        fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a job holds it: still running
        shutil.rmtree(run, ignore_errors=True)
        return True
    finally:
        os.close(fd)
