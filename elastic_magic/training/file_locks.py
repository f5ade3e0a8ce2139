"""Open-file-description locks (``F_OFD_SETLK``): held by an open file description, so
every duplicate of a descriptor keeps it until the last is closed, and two descriptors a
process opened on its own (through /proc) do not share one. The agent's snapshot files
are reused only once no one holds a lock on them (``agent/node/commit_files.py``)."""

from __future__ import annotations

import errno
import fcntl
import os
import struct

_FLOCK = struct.Struct("hhqqi4x")  # struct flock: type, whence, start, length (0: all), pid


def ofd_lock(fd: int, kind: int) -> bool:
    """Take a lock of ``kind`` (fcntl.F_RDLCK, F_WRLCK; F_UNLCK drops it) on the whole file
    for this descriptor's open file description; False where another description holds
    a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True
