"""What other threads may know of a running job: an immutable snapshot that the agent
replaces as the job changes, and waits on a condition instead of polling."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..result import JobState


def _no_pids() -> Mapping[int, int]:
    return MappingProxyType({})


@dataclass(frozen=True)
class JobStatus:
    """A running job at one moment, for the threads that are not the agent's (the kernel's,
    the dashboard's): replaced whole when anything changes, so read without a lock."""

    state: JobState = JobState.RENDEZVOUS
    world_size: int = 0
    nnodes: int = 0
    restarts: int = 0
    # rank -> the PID of the process that runs its cell, once it runs; and of its shepherd
    # (the process we spawned, signal and reap), while it lives; both of ranks here
    pids: Mapping[int, int] = field(default_factory=_no_pids)
    shepherds: Mapping[int, int] = field(default_factory=_no_pids)
    join_command: str | None = None  # set once other machines can join
    last_commit: Mapping[str, Any] | None = None  # step, time, world size
    excluded: tuple[str, ...] = ()  # what the job goes on without (slots, machines), and why
    machines: tuple[str, ...] = ()  # a --launcher's allocations: state, the scheduler's reason
    started: float = field(default_factory=time.time)
    finished: float | None = None
    done: bool = False  # the agent thread has ended: the result (or error) is there

    @property
    def elapsed(self) -> float:
        return (self.finished or time.time()) - self.started


class StatusBoard:
    """One writer (the agent thread), any number of readers."""

    def __init__(self) -> None:
        self._status = JobStatus()
        self._changed = threading.Condition()

    @property
    def current(self) -> JobStatus:
        return self._status  # replaced, never mutated: reading it needs no lock

    def publish(self, **changes: Any) -> None:
        for pids in ("pids", "shepherds"):
            if pids in changes:
                changes[pids] = MappingProxyType(dict(changes[pids]))
        if "last_commit" in changes and changes["last_commit"] is not None:
            changes["last_commit"] = MappingProxyType(dict(changes["last_commit"]))
        with self._changed:
            self._status = dataclasses.replace(self._status, **changes)
            self._changed.notify_all()

    def wait_for(self, ready: Callable[[JobStatus], bool],
                 timeout: float | None = None) -> JobStatus:
        """Block until ``ready(status)`` or the job is done or ``timeout`` passed; the
        status then."""
        with self._changed:
            self._changed.wait_for(lambda: ready(self._status) or self._status.done, timeout)
            return self._status
