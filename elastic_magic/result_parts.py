"""What a JobResult holds beside its values: a rank's value that could not travel back to
the kernel, a snapshot left in the agent's memory file, and the scalars the cell logged
(``result.py`` imports them)."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Unpicklable:
    """Stands in for a rank's value that could not be sent back to the kernel."""

    repr: str
    reason: str

    def __repr__(self) -> str:
        return f"<not transferable: {self.repr} ({self.reason})>"


class MemorySnapshot:
    """A finished job's last snapshot, left in the anonymous memory file the agent kept it
    in: a result kept in the notebook costs no heap until its snapshot is read."""

    def __init__(self, fd: int) -> None:
        """Owns ``fd`` (closed with this object)."""
        self.size = os.fstat(fd).st_size
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def read(self) -> bytes:
        # A description of its own: reads from its start, whatever else reads the file.
        with open(f"/proc/self/fd/{self._fd}", "rb") as file:
            data = file.read()
        if len(data) != self.size:
            raise OSError(f"the snapshot's memory file holds {len(data)} bytes, not "
                          f"{self.size}")
        return data


@dataclass
class MetricSeries:
    """One scalar the cell logged with ``elastic_magic.log``: its points in the order they
    came (each rank's in its own order), as plain lists of one length.

    Attributes:
        steps: The step of each point (the State's, or the rank's count of log calls).
        values: The logged values, as floats.
        times: When each was logged (seconds since the epoch, the rank's clock).
        ranks: The rank that logged each.
    """

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)
