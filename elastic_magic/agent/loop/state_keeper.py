"""The elastic ``State`` as the agent sees it: the snapshots (held here, or by the head for a
machine that joined), the workers' requests served, each commit announced. A pending resize
applies at a commit when the engine says so (``leave_at_commit``). A commit every rank agreed
on lands before its group is torn down (``let_commit_land``)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ...result import MemorySnapshot
from ...spec import JobSpec
from ...wire.events import CheckpointMoved, CheckpointVanished, Committed, EventSink
from ...wire.messages import Action, Commit, CommitIntent, StateRequest
from ..machines.roles import SingleMachine
from ..node.snapshots import SnapshotStore, StateServer
from ..node.workers import Worker
from ..status import StatusBoard

# How long a teardown waits for a commit in flight (rank 0 sends it behind its training).
# One that takes longer (a snapshot of many GB) is given up: the job resumes from the one
# before, and the steps since run again, as after any failure.
COMMIT_LANDING = 2.0


class StateKeeper:
    """One job's snapshots and their server on this machine."""

    def __init__(self, spec: JobSpec, role: SingleMachine, board: StatusBoard,
                 emit: EventSink, leave_at_commit: Callable[[], bool]) -> None:
        self.role = role
        self.board = board
        self.emit = emit
        self.snapshots = SnapshotStore(spec.checkpoint_dir,
                                       trust_path=spec.checkpoint_shared,
                                       moved=spec.checkpoint_moved)
        self.server = StateServer(self.snapshots, self._committed, leave_at_commit) \
            if role.holds_snapshots else None
        self.used = False  # a worker (here or on another machine) asked for State
        # The rank of this machine that began the commit not yet kept, and its attempt.
        self.landing: tuple[Worker, int] | None = None

    def resume(self) -> None:
        """Before the first round: the snapshot of ``--checkpoint-dir``, if there is one."""
        if self.server is not None:
            self.server.resume_from_checkpoint()
        snapshots = self.snapshots
        if snapshots.directory is None:
            return
        if snapshots.vanished is not None:
            self.emit(CheckpointVanished(str(snapshots.directory), *snapshots.vanished))
        if snapshots.moved and snapshots.meta is not None:
            self.emit(CheckpointMoved(str(snapshots.directory), snapshots.moved_past))

    def serve(self, worker: Worker, request: StateRequest, world_size: int) -> None:
        self.used = True
        if isinstance(request, CommitIntent) and self.server is not None:  # rank 0 begins one
            self.landing = (worker, worker.attempt)
        self.role.serve(worker, request, self.server, world_size)
        if isinstance(request, Commit) and self.landing and self.landing[0] is worker:
            self.landing = None  # rank 0's commit (its part of a sharded one) is in

    def let_commit_land(self, next_action: Callable[[float], Action | None]) -> None:
        """Before a teardown: the commit that rank 0 began lands, serving the ranks'
        requests meanwhile, unless rank 0 ended or failed first (a peer died before every
        rank agreed on the commit: it will not come), or a stop was asked for. A rank that
        dies just after a commit has made it with the others; without this, the commit in
        flight would be lost and its step run again."""
        deadline = time.monotonic() + COMMIT_LANDING
        while self.landing is not None and (left := deadline - time.monotonic()) > 0:
            worker, attempt = self.landing
            if worker.attempt != attempt or worker.error is not None \
                    or worker.ended_at is not None or not worker.alive():
                break
            if next_action(min(left, 0.01)) is Action.STOP:
                break
        self.landing = None

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
