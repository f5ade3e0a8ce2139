"""Every message that crosses a process or machine boundary, as frozen dataclasses.

Three conversations share this vocabulary, each over signed frames (``wire/protocol.py``):

- agent -> worker (control pipe): :class:`Run`, :class:`Reply`, :class:`Exit`,
  :class:`DumpStacks`, :class:`Interrupt`;
- worker -> agent (report pipe): :class:`Running`, :class:`Result`, :class:`Failed`,
  :class:`Resized`, :class:`Imported` (what the warm pool should preload), the State
  requests :class:`StateGet`, :class:`CommitIntent` and :class:`Commit`,
  :class:`Progress` and :class:`Stacks` for hang diagnosis, ``metrics.Logged`` (scalars);
- head <-> joined machine (a hub link): ``link_messages`` (its ``LinkMessage`` union, a
  session's cells and their reports among them) and ``chunk_messages``.

Receivers dispatch with ``match``; workers import this module: it imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..stacks import ThreadStack
from .chunk_messages import CommitTarget, Handoff
from .metrics import Logged

if TYPE_CHECKING:
    from concurrent.futures import Future

    from .payload import Payload


# -- agent -> worker ------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """The agent to a worker: run ``payload`` (a job's cell, or a session's next cell)."""

    payload: Payload
    stay: bool = False  # survivors stay: park after a failure or a resize, not exit
    env: dict[str, str] | None = None  # a survivor's variables for its new group


@dataclass(frozen=True)
class Reply:
    """The answer to a worker's request (``StateGet`` or ``Commit``)."""

    request_id: int
    value: StateReply | CommitReply


@dataclass(frozen=True)
class Exit:
    """Leave the worker loop (after the last payload)."""


@dataclass(frozen=True)
class DumpStacks:
    """Report every thread's stack: the control listener answers, the main thread runs on."""

    request_id: int


@dataclass(frozen=True)
class Interrupt:
    """KeyboardInterrupt in the rank's running code (none when it is idle): a session's
    cell, or a survivor's payload (it parks: the group re-forms); the worker lives on.
    ``group_ends``: the rank leaves its group, whose store goes with it (a wait there for a
    peer that died ends too)."""

    group_ends: bool = False


# -- worker -> agent ------------------------------------------------------------------

@dataclass(frozen=True)
class Running:
    """The worker is set up (device, process group, globals) and runs user code as ``pid``."""

    time: float
    pid: int


@dataclass(frozen=True)
class Result:
    """A rank's outcome: its value and pulled variables, cloudpickled."""

    value: bytes
    pulled: dict[str, bytes] = field(default_factory=dict)
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class ErrorInfo:
    """What a worker knows about the exception that ended it."""

    exc_type: str
    message: str
    traceback: str
    time: float
    exit_code: int
    cell_line: int | None = None
    source_line: str | None = None


@dataclass(frozen=True)
class Failed:
    """A worker to its agent: the rank's code raised (``error`` says what and where)."""

    error: ErrorInfo


@dataclass(frozen=True)
class Resized:
    """The worker left at a commit that applied a resize."""

    step: Any
    time: float


@dataclass(frozen=True)
class Parked:
    """Survivors stay: the rank left its payload and group, and waits for the next Run."""

    why: str  # the error it reported, a resize, the agent's Interrupt
    time: float


@dataclass(frozen=True)
class Imported:
    """Modules (name, file) a pooled worker imported beyond its zygote: the pool preloads them."""

    modules: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class StateGet:
    """Ask for the latest snapshot (``inline``: as bytes, not a memory file); ``held``: the token
    of the commit a survivor holds in its own memory, so that the latest is not sent again."""

    request_id: int
    inline: bool = False
    held: int = 0


@dataclass(frozen=True)
class Commit:
    """A new snapshot: in ``snapshot`` (bytes), in a memory file the worker offers, or ``written``
    into the agent's file for it (``CommitTarget``). A sharded State's snapshot comes in ``parts``
    parts of ``sizes`` bytes, one per rank, in any order: the last of the parts with the same
    ``token`` (rank 0's random number for this commit) completes the commit."""

    request_id: int
    step: Any
    time: float
    snapshot: bytes | None = None
    handoff: Handoff | None = None
    part: int = 0
    parts: int = 1
    token: int = 0
    sizes: tuple[int, ...] = ()
    written: bool = False
    samples: int | None = None  # the data position's count (ElasticSampler), for samples/s


@dataclass(frozen=True)
class CommitIntent:
    """Rank 0 is about to commit: must every rank leave at it (a resize, machines waiting)?"""

    request_id: int


@dataclass(frozen=True)
class Progress:
    """The rank's main thread has moved since its last report (sampled; at most one a second)."""

    time: float


@dataclass(frozen=True)
class Stacks:
    """The answer to :class:`DumpStacks`."""

    request_id: int
    threads: tuple[ThreadStack, ...]


StateRequest = StateGet | Commit | CommitIntent | CommitTarget
WorkerMessage = (Running | Result | Failed | Resized | Parked | StateGet | Commit
                 | CommitIntent | CommitTarget | Progress | Stacks | Imported | Logged)


@dataclass(frozen=True)
class StateReply:
    """The agent's answer to a StateGet (in a Reply): the latest commit, and its snapshot."""

    commit_id: int
    snapshot: bytes | None = None
    handoff: Handoff | None = None
    token: int = 0  # the commit's: a survivor holding the same rolls back from its memory


@dataclass(frozen=True)
class CommitReply:
    """The agent's answer to a Commit or a CommitIntent (in a Reply)."""

    resize: bool = False  # every rank leaves at this commit
    handoff_failed: bool = False  # the agent cannot read the memory file: use the pipe
    target: Handoff | None = None  # where to write the part (CommitTarget)
    error: str | None = None  # the commit was not kept: why


# -- commands into an agent (from any kernel thread) ----------------------------------

@dataclass(frozen=True)
class StopCommand:
    """A kernel thread to its agent: end the job, for ``reason``."""

    reason: str = "stopped"


@dataclass(frozen=True)
class ScaleCommand:
    """A kernel thread to its agent: ``nproc`` workers here, at once or at the next commit."""

    nproc: int
    immediate: bool = False
    include: tuple[int, ...] = ()  # excluded worker slots named back


@dataclass(frozen=True)
class StacksCommand:
    """Gather every rank's stacks; the agent sets ``answer`` to {rank: formatted text}."""

    answer: Future[dict[int, str]]


class Action(Enum):
    """What an incoming message asks the agent's loop to do."""

    STOP = "stop"  # end the job
    REGROUP = "regroup"  # leave the group now; the next round re-forms it
    NODE_FAILED = "node_failed"  # another machine failed for good: end here too
