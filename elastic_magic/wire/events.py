"""Typed, timestamped events emitted by the agent. Renderers consume them; the agent knows
nothing about who listens."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# JobState lives with JobResult; importing it from here keeps working.
from ..result import JobResult, JobState, RankFailure
from .metrics import Logged


def _now() -> float:
    return time.time()


@dataclass(frozen=True)
class StateChanged:
    """The job moved to another state (running, resizing, stopping...)."""

    state: JobState
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class RendezvousCompleted:
    """A rendezvous round closed: the new group's size, this machine's node rank in it,
    where its process group meets (``master_addr``), and every machine's (name, ranks)."""

    round: int
    node_rank: int
    nnodes: int
    world_size: int
    master_addr: str
    master_port: int
    machines: tuple[tuple[str, int], ...] = ()
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class WorkersStarted:
    """This machine's ranks of a new group run: in new processes, or in those they stayed in."""

    attempt: int
    restart_count: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...]  # their shepherds (the processes spawned); RanksRunning: the cells'
    stayed: tuple[int, ...] = ()  # survivors stay: ranks whose process ran the group before
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class RanksRunning:
    """Every rank of this machine's group has reached its cell, each in process ``pids``
    (its ``os.getpid()``, the one to give kill, py-spy or top; not its shepherd's)."""

    attempt: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...]
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Output:
    """Whole lines from one rank's stdout or stderr, in order, each as it finally shows
    (after its last carriage return). With ``partial``, the last one is a line still being
    rewritten with carriage returns (a progress bar), as it shows now: it stands until the
    next Output of this rank and stream, whose first line replaces it. With ``cell_end``,
    the rank's session cell has written all its output on this stream (its nonced mark,
    taken out of the lines; the session's agent takes the flag off)."""

    rank: int
    stream: str  # "stdout" | "stderr"
    lines: tuple[str, ...]
    attempt: int
    time: float = field(default_factory=_now)
    partial: bool = False
    cell_end: bool = False


@dataclass(frozen=True)
class WorkerFailed:
    """A rank failed (it raised, died, stalled...) or stopped because another did
    (``failure.consequence``); a group's failures come root cause first."""

    failure: RankFailure
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class RanksFinished:
    """Ranks returned their results while others of the group still run (news: a rank that
    leaves a collective job early makes the others wait in vain)."""

    ranks: tuple[int, ...]
    running: tuple[int, ...]
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Restarting:
    """The group starts again after a failure, with restarts left; ``root_cause`` is why."""

    restart_count: int  # the restart about to begin (1 for the first)
    max_restarts: int
    root_cause: RankFailure
    # the first restart of a job whose ranks never used State: the cell runs from its start
    no_state: bool = False
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Committed:
    """The agent holds a new snapshot of the elastic State."""

    step: Any
    world_size: int
    nbytes: int
    origin: str = "commit"  # or "checkpoint": loaded from --checkpoint-dir at start
    samples: int | None = None  # the data position's samples so far (ElasticSampler)
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class CheckpointVanished:
    """--checkpoint-dir holds no checkpoint, though this machine's record says that its
    ``counter``-th was written there at ``written`` (epoch seconds): the job starts from
    scratch, which the user may not expect."""

    path: str
    counter: int
    written: float
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class CheckpointMoved:
    """What --checkpoint-moved did at the start: resumed from a checkpoint that would have
    been refused for ``overlooked``, or nothing (None: the checkpoint was the folder's
    latest, here), and the flag, still on the cell, would let a later swap through."""

    path: str
    overlooked: str | None
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class ResizeRequested:
    """A new worker count for this machine was asked for and will apply: at the next commit
    (``graceful``) or at once."""

    target: int  # workers on this machine
    graceful: bool  # applied at the next commit, else at once
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class MembershipChanged:
    """A group with a different number of workers on this machine is about to form
    (a membership change: it does not count as a restart)."""

    old_nproc: int
    new_nproc: int
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class AcceptingNodes:
    """A multi-node job: other machines join with ``command``."""

    endpoint: str
    command: str
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class MachinesChanged:
    """A --launcher's allocations changed: each as ``ID: state (reason) on WHERE``."""

    allocations: tuple[str, ...]
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class NodeConnected:
    """A machine connected to (or left) this job's hub; ``reason`` when its link failed."""

    peer: str
    nproc: int
    connected: bool
    reason: str = ""
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class Excluded:
    """The job lost, or gave up on, a machine or a worker slot of this machine. With
    ``goes_on`` the others regroup without it from the last commit (not a restart);
    otherwise too few are left and the job fails with it as the root cause."""

    what: str  # "machine 10.0.0.2 (node 1)", "slot 1 of this machine"
    why: str
    goes_on: bool
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class CellStarted:
    """A session's cell starts on a group that was formed earlier: the view of the cell
    learns the group (not news: no sentence)."""

    attempt: int
    ranks: tuple[int, ...]
    world_size: int
    nnodes: int
    round: int
    restart_count: int
    # When the session took the cell up: a group re-formed for it counts as the cell's time
    # (its JobResult's ``started``), and events kept from the idle time before do not.
    began: float = 0.0
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SessionBroken:
    """A session's group cannot run the next cell (a rank died, or did not come back from
    an interrupt): it is re-formed before the next cell, or the session ends (restarts
    spent)."""

    reason: str
    restart_count: int  # the re-formation it will be (restarts so far, this one included)
    max_restarts: int
    reforms: bool
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SessionReformed:
    """A session's group was formed again: setup cells replayed, State restored."""

    setup_cells: int
    step: Any  # of the State restored; None when the session keeps no State
    world_size: int
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class NetworkChosen:
    """A multi-node job: the interface this machine's workers reach the other machines
    through (see agent/node/network.py), and whether its hostname resolves to loopback."""

    machine: str  # this machine's address as the others reach it
    interface: str | None  # the interface carrying it; None: none found
    variables: tuple[tuple[str, str], ...]  # set for the workers
    kept: tuple[tuple[str, str], ...]  # the user's own settings, which win
    hostname: str
    hostname_address: str | None  # what the hostname resolves to; None: it does not
    time: float = field(default_factory=_now)

    @property
    def hostname_is_loopback(self) -> bool:
        """What gloo and NCCL would offer the other machines without an interface named."""
        address = (self.hostname_address or "").split("%")[0]
        return address.startswith("127.") or address == "::1"

    @property
    def machine_is_loopback(self) -> bool:
        """Every machine is on this host (the head's endpoint is a loopback address)."""
        address = self.machine.split("%")[0]
        return address.startswith(("127.", "::ffff:127.")) or address == "::1"


@dataclass(frozen=True)
class JobFinished:
    """The job (or a session's cell) ended: its result, the last event its view gets."""

    result: JobResult
    time: float = field(default_factory=_now)


Event = (
    StateChanged | RendezvousCompleted | WorkersStarted | RanksRunning | Output | WorkerFailed
    | Restarting | Committed | ResizeRequested | MembershipChanged | AcceptingNodes | NodeConnected
    | JobFinished | RanksFinished | NetworkChosen | Excluded | CellStarted | SessionBroken
    | SessionReformed | MachinesChanged | CheckpointVanished | CheckpointMoved | Logged
)
EventSink = Callable[[Event], None]


class HeldOutput:
    """The output pumps' sink while a group starts: a rank handed its cell first (from the
    pool) prints before the rest have started, and a view begins an attempt's panes at its
    ``WorkersStarted``; so a new group's lines wait until that event is out (``release``)."""

    def __init__(self, emit: EventSink) -> None:
        self._emit = emit
        self._held: list[Event] | None = []  # None once released
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            if self._held is not None:
                self._held.append(event)
                return
        self._emit(event)

    def __enter__(self) -> HeldOutput:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Emit what was held, in order, and pass everything on from now on."""
        with self._lock:
            held, self._held = self._held or [], None
            for event in held:
                self._emit(event)
