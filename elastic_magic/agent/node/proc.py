"""What /proc tells of a rank's processes, read without a system call that could wait."""

from __future__ import annotations

import signal

from ...worker.shepherd import NAME as SHEPHERD_NAME

_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
_PF_EXITING = 0x4  # in /proc/PID/stat's flags: the process is in exit (its sockets closing)


def worker_gone(shepherd: int) -> bool:
    """The worker under ``shepherd`` has died, though the agent may not have seen it yet:
    the shepherd has no living child. None at all is a worker reaped, or one not yet forked
    (the shepherd names itself before it reaps). False when that cannot be read."""
    try:
        with open(f"/proc/{shepherd}/task/{shepherd}/children", "rb") as file:
            children = file.read().split()
        if not children:
            with open(f"/proc/{shepherd}/comm", "rb") as file:
                return file.read().strip() == SHEPHERD_NAME.encode()
    except OSError:
        return False
    return not any(_living(int(child)) for child in children)


def _living(pid: int) -> bool:
    """The process exists, is no zombie, is not exiting (a GPU rank's exit can take a while
    as its driver lets go, its sockets closed already) and has no SIGKILL pending (one
    sent a moment ago is pending until the process is scheduled to die)."""
    try:
        stat = _stat(pid)
        state, flags = stat[0], int(stat[6])
        with open(f"/proc/{pid}/status", "rb") as file:
            fields = dict(line.split(b":", 1) for line in file.read().splitlines()
                          if b":" in line)
        pending = int(fields[b"SigPnd"], 16) | int(fields[b"ShdPnd"], 16)
    except (OSError, KeyError, IndexError, ValueError):
        return False
    return state not in (b"Z", b"X") and not flags & _PF_EXITING \
        and not pending & _SIGKILL_BIT


def parent_pid(pid: int) -> int | None:
    """The process's parent, or None when it is gone."""
    try:
        return int(_stat(pid)[1])
    except (OSError, IndexError, ValueError):
        return None


def _stat(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields after the name (which may hold spaces and parentheses):
    state, parent, process group, session, terminal, its group, flags, ..."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        return file.read().rpartition(b")")[2].split()
