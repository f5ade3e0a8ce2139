"""The command other machines run to join, as the notebook shows it: the job's token stays
out of it. A notebook's outputs are saved, shared and committed (autosaved into a team's
folder, say), and the token lets whoever holds it run code in the kernel; so the head writes
it to a file only the user can read, which the command names (``--token-file``). A cluster's
machines usually share the home folder that holds it; elsewhere the file is copied over, or
its content given as ``ELASTIC_MAGIC_TOKEN``. The file goes when the job ends; one that a
killed kernel left is removed by the next job on that host (its name says which host, pid
namespace and process wrote it, so a home folder shared by a cluster's hosts keeps theirs)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import socket
from pathlib import Path

from ... import folders


class TokenFile:
    """A job's token in a 0600 file of the user's private token folder, and the join
    command that names it."""

    def __init__(self, run_id: str, token: str, folder: Path | None = None) -> None:
        self.path: Path | None = None
        self.problem: str | None = None  # why no file could be written
        try:
            fd, real = folders.own_path(folders.absolute(folder or folders.token_folder()),
                                        create=True, private=True)
        except (folders.NotPrivate, OSError) as exc:
            self.problem = str(exc)
            return
        name = f"{run_id}-{secrets.token_hex(4)}.{_process_mark(os.getpid())}@{_HOST}"
        try:
            _remove_stale(fd)
            with os.fdopen(folders.new_file(fd, name), "w") as file:
                file.write(token)
            self.path = real / name
        except OSError as exc:
            self.problem = str(exc)
        finally:
            os.close(fd)

    def command(self, endpoint: str) -> str:
        """What other machines run; without a file, what to give them instead."""
        if self.path is not None:
            return f"elastic-magic join {endpoint} --token-file {shlex.quote(str(self.path))}"
        return (f"ELASTIC_MAGIC_TOKEN=... elastic-magic join {endpoint} (the token is "
                f"`job.token`: no private file could hold it, {self.problem})")

    def remove(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def _host() -> str:
    """This host as its processes' pids mean something: its name, machine id and pid
    namespace (hosts of one name, or containers, sharing a home folder, each have pids of
    their own; the first pid namespace has the same number everywhere)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        namespace = "0"
    try:
        machine = Path("/etc/machine-id").read_text().strip()[:12] or "0"
    except OSError:
        machine = "0"
    return f"{socket.gethostname()}+{machine}+{namespace}"


_HOST = _host()
_NAME = re.compile(r".+-[0-9a-f]{8}\.(\d+)\.(\d+)@(.+)")


def _process_mark(pid: int) -> str:
    """``pid.start``: its start time (clock ticks since boot) tells a pid used again."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return f"{pid}.{stat.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return f"{pid}.0"


def _remove_stale(folder: int) -> None:
    """The token files of this host's processes that are gone (a kernel killed before its
    job could remove its file): a dead job's token serves nobody."""
    for name in os.listdir(folder):
        match = _NAME.fullmatch(name)
        if match and match[3] == _HOST and \
                _process_mark(int(match[1])) != f"{match[1]}.{match[2]}":
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder)
