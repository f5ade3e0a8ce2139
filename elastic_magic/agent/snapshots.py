"""The agent's copy of the elastic State: the latest committed snapshot, in memory and,
with a checkpoint directory, on disk (written atomically: a crash mid-write leaves the
previous checkpoint whole).

In memory, a snapshot is either bytes (from the pipe, another machine or a checkpoint) or
a descriptor of the anonymous memory file the committing worker wrote it into: the agent
keeps that file open instead of copying it, and workers read it back through /proc.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
            _write_atomically(self.directory / _DATA, data if fd is None else fd, self.size)
            _write_atomically(self.directory / _META, json.dumps(meta).encode())

    def close(self) -> None:
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
