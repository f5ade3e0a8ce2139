"""The agent's copy of the elastic State: the latest committed snapshot, in memory and,
with a checkpoint directory, on disk (written atomically: a crash mid-write leaves the
previous checkpoint whole)."""

from __future__ import annotations

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
    blob: bytes | None = None
    commit_id: int = 0
    meta: dict[str, Any] | None = None

    def load_checkpoint(self) -> bool:
        """Take the snapshot a previous run left in the directory, if any."""
        if self.directory is None or not (self.directory / _META).exists():
            return False
        self.meta = json.loads((self.directory / _META).read_text())
        self.blob = (self.directory / _DATA).read_bytes()
        return True

    def commit(self, blob: bytes, meta: dict[str, Any]) -> None:
        self.blob, self.meta = blob, meta
        self.commit_id += 1
        if self.directory is not None:
            _write_atomically(self.directory / _DATA, blob)
            _write_atomically(self.directory / _META, json.dumps(meta).encode())


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
