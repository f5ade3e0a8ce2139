"""Where a user's detached jobs are found: one private folder (0700, the user's alone) under
the user's cache, holding each job's socket and its connection file (0600: the run id, the
agent's PID, the token that proves an attaching kernel is the user's). Another user can
neither list the folder nor reach a socket in it; a file there that is not the user's own,
or that others may read, is refused, never trusted."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import folders


def runtime_folder() -> Path:
    """``~/.cache/elastic_magic/detached/HOSTNAME``, made private if new.

    Raises:
        NotPrivate: It exists and someone else owns it or may write to or read it.
    """
    cache = folders.cache_folder()
    where = cache / "detached" if cache else Path(
        tempfile.gettempdir(), f"elastic_magic-{os.getuid()}", "detached")
    # A home folder a cluster's machines share: each machine's jobs apart (their PIDs and
    # sockets mean nothing on another machine).
    where /= re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    fd, real = folders.own_path(where, create=True, private=True)
    os.close(fd)
    return real


@dataclass(frozen=True)
class Connection:
    """How to reach one detached job's agent."""

    run_id: str
    pid: int
    folder: str  # where its socket is (the runtime folder)
    token: str
    started: float
    title: str  # the cell's first line, as ``%elastic attach`` lists it

    def write(self, folder: Path) -> Path:
        """Written whole (a reader never sees half of it), mode 0600."""
        path = folder / f"{self.run_id}.json"
        temporary = folder / f".{self.run_id}.json.new"
        fd = os.open(temporary, folders.NEW_FILE, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out)
        os.replace(temporary, path)
        return path


def socket_name(run_id: str) -> str:
    return f"{run_id}.sock"


def at_socket(sock: socket.socket, folder: Path, name: str, *, bind: bool) -> None:
    """Bind or connect ``sock`` to ``folder/name`` through a descriptor of the folder: a
    unix socket's path may be 107 bytes at most, which a deep home folder exceeds."""
    fd = os.open(folder, folders.PASS_DIR)
    try:
        path = f"/proc/self/fd/{fd}/{name}"
        sock.bind(path) if bind else sock.connect(path)
    finally:
        os.close(fd)


def connections(folder: Path | None = None) -> list[Connection]:
    """The user's detached jobs on this machine whose agent still runs, oldest first."""
    folder = folder or runtime_folder()
    found = []
    for path in sorted(folder.glob("em-*.json")):
        connection = read(path)
        if connection is not None and alive(connection.pid, connection.started):
            found.append(connection)
        elif connection is not None:  # its agent was killed: nothing to attach to
            remove(folder, connection.run_id)
    return sorted(found, key=lambda c: c.started)


def read(path: Path) -> Connection | None:
    """The connection file at ``path``: None unless it is the user's own, private file."""
    try:
        fd = os.open(path, folders.READ_FILE)
    except OSError:
        return None
    with os.fdopen(fd) as file:
        if folders.private_file_problem(fd, path) is not None:
            return None
        try:
            connection = Connection(**json.load(file))
        except (ValueError, TypeError):
            return None
    fields: dict[str, type | tuple[type, ...]] = {
        "run_id": str, "pid": int, "folder": str, "token": str, "started": (int, float),
        "title": str}
    if not all(isinstance(getattr(connection, name), kind) for name, kind in fields.items()) \
            or not 0 < connection.pid < 2**22:  # the kernel's pid_max at most
        return None  # not one an agent wrote: nothing to reach
    return connection


def remove(folder: Path, run_id: str, *, log: bool = False) -> None:
    """A job's connection file and socket (and its agent's log, once it ended well)."""
    for name in (f"{run_id}.json", socket_name(run_id), *([f"{run_id}.log"] if log else [])):
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()


def peer_uid(sock: socket.socket) -> int:
    """The user of the process at the other end of a unix socket (the kernel's word)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def alive(pid: int, started: float | None = None) -> bool:
    """Whether a live process of the user's has this PID on this machine (one that died
    and waits to be reaped, a zombie, is not); with ``started``, one that began before that
    time (after a reboot another process may have the PID)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rpartition(b")")[2].split()
    except (ProcessLookupError, PermissionError, FileNotFoundError):
        return False  # gone; or another user's process has that PID now
    if len(fields) < 20 or fields[0] == b"Z":
        return False
    return started is None or _start_time(int(fields[19])) <= started + 1.0


def _start_time(ticks: int) -> float:
    """A process's start (``/proc/PID/stat``'s field 22, clock ticks after boot) as a time."""
    with open("/proc/stat", "rb") as stat:
        boot = next(int(line.split()[1]) for line in stat if line.startswith(b"btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
