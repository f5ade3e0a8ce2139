"""The elastic ``State`` as the agent sees it: the snapshots (held here, or by the head for a
machine that joined), the workers' requests served, each commit announced. A pending resize
applies at a commit when the engine says so (``leave_at_commit``)."""

from __future__ import annotations

import os
from collections.abc import Callable

from ...events import Committed, EventSink
from ...messages import StateRequest
from ...result import MemorySnapshot
from ...spec import JobSpec
from ..local.snapshots import SnapshotStore, StateServer
from ..local.workers import Worker
from ..machines.roles import SingleMachine
from ..status import StatusBoard


class StateKeeper:
    """One job's snapshots and their server on this machine."""

    def __init__(self, spec: JobSpec, role: SingleMachine, board: StatusBoard,
                 emit: EventSink, leave_at_commit: Callable[[], bool]) -> None:
        self.role = role
        self.board = board
        self.emit = emit
        self.snapshots = SnapshotStore(spec.checkpoint_dir)
        self.server = StateServer(self.snapshots, self._committed, leave_at_commit) \
            if role.holds_snapshots else None
        self.used = False  # a worker (here or on another machine) asked for State

    def resume(self) -> None:
        """Before the first round: the snapshot of ``--checkpoint-dir``, if there is one."""
        if self.server is not None:
            self.server.resume_from_checkpoint()

    def serve(self, worker: Worker, request: StateRequest, world_size: int) -> None:
        self.used = True
        self.role.serve(worker, request, self.server, world_size)

    def _committed(self, event: Committed) -> None:
        self.board.publish(last_commit=self.snapshots.meta)
        self.emit(event)

    def kept(self) -> bytes | MemorySnapshot | None:
        """The last snapshot for the job's result: its memory file stays out of the heap
        (a copy of the whole state there for every finished job), read when asked for."""
        if self.snapshots.memory_file is not None:
            return MemorySnapshot(os.dup(self.snapshots.memory_file))
        return self.snapshots.blob

    def close(self) -> None:
        # The State server calls back into the engine: without this, the stores and pipes
        # would wait for the garbage collector (a notebook ran out of files).
        self.server = None
        self.snapshots.close()
