"""The head and a joined machine's conversation over a hub link
(``agent/machines/hub.py``): the offer, the machine's Hello, its ranks' events, State
requests and replies, results, leaving and regrouping, a session's cells and their reports,
stacks; ``chunk_messages`` holds the snapshot chunks that cross beside them. The
``LinkMessage`` union at the end names them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..result import JobState, RankFailure
from .chunk_messages import ChunkKept, ChunkPiece
from .messages import Reply, Result, StateRequest

if TYPE_CHECKING:
    from ..spec import JobSpec
    from .payload import Payload


@dataclass(frozen=True)
class JobOffer:
    """The head's first frame to a machine that proved the token."""

    run_id: str
    spec: JobSpec
    payload: Payload


@dataclass(frozen=True)
class Hello:
    """A joined machine to the head, once it has the JobOffer: its host, workers and allocation."""

    host: str
    nproc: int
    pid: int = 0  # its agent's: with ``host``, how torch's rendezvous names the machine
    allocation: str = ""  # the launcher's allocation it runs in (SLURM_JOB_ID, say)


@dataclass(frozen=True)
class RankEvents:
    """An event of the machine's ranks (output, failures) for the notebook to show."""

    event: Any


@dataclass(frozen=True)
class NodeRequest:
    """A joined machine's worker asks for State (``agent/machines/remote_state.py``)."""

    attempt: int
    local_rank: int
    request: StateRequest
    streamed: int | None = None  # the size of the commit's chunk, sent before in pieces
    have: tuple[tuple[int, int], ...] = ()  # (part, token): chunks held there


@dataclass(frozen=True)
class NodeReply:
    """The head's answer to a NodeRequest: the Reply for that machine's worker."""

    attempt: int
    local_rank: int
    reply: Reply
    streamed: int | None = None  # the size of the restore, sent before in pieces
    local: tuple[tuple[int, int, int], ...] = ()  # (part, token, offset): filled in there


@dataclass(frozen=True)
class GroupResult:
    """A joined machine's group succeeded in round ``round_id``."""

    round_id: str
    node_rank: int
    results: dict[int, Result]
    tails: dict[int, list[str]]


@dataclass(frozen=True)
class NodeFinished:
    """A joined machine to the head as its job ends there: how, and its ranks' failures."""

    state: JobState
    failures: list[RankFailure]


@dataclass(frozen=True)
class Leaving:
    """A joined machine is about to stop its ranks: regroup without it."""

    reason: str


@dataclass(frozen=True)
class LeaveAtCommit:
    """A joined machine got its scheduler's SIGTERM: it asks to go at the next commit."""

    reason: str


@dataclass(frozen=True)
class ReleaseAtCommit:
    """The head: leave the job once the group has left at its next commit (or at the end
    of the group, whatever ends it); do not join another round."""

    reason: str


@dataclass(frozen=True)
class Regroup:
    """Leave the group of round ``round_id`` now and re-rendezvous (the head to every
    machine; a machine whose group failed to the head). A machine no longer in that group
    ignores it: it regroups already, and a Regroup that reaches it in its next round (sent
    as it joined) must not break that round."""

    round_id: str


@dataclass(frozen=True)
class EndJob:
    """The head: the job is over."""

    reason: str


@dataclass(frozen=True)
class Heartbeat:
    """Either side, every ``--link-timeout``/4 seconds: the link is alive."""


@dataclass(frozen=True)
class StacksRequest:
    """The head: send me your ranks' stacks."""

    request_id: int


@dataclass(frozen=True)
class NodeStacks:
    """A joined machine's answer to :class:`StacksRequest`: {global rank: text}."""

    request_id: int
    stacks: dict[int, str]


@dataclass(frozen=True)
class SessionCell:
    """The head of a session: run ``payload`` (cell ``seq`` of this round, or a setup cell
    replayed) on your ranks among ``ranks`` (None: all). Seq 0 is the group starting."""

    round_id: str
    seq: int
    payload: Payload
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class InterruptCell:
    """The head of a session: KeyboardInterrupt in your ranks' running cell."""

    round_id: str
    seq: int


@dataclass(frozen=True)
class CellReport:
    """A joined machine's answer to :class:`SessionCell` (seq 0: its group is up; seq -1: a
    rank died between cells). ``broken``: its group is gone."""

    round_id: str
    seq: int
    node_rank: int
    results: dict[int, Result]
    failures: list[RankFailure]
    broken: bool = False


LinkMessage = (JobOffer | Hello | RankEvents | NodeRequest | NodeReply | GroupResult
               | NodeFinished | Leaving | LeaveAtCommit | ReleaseAtCommit | Regroup | EndJob
               | StacksRequest | NodeStacks | ChunkPiece | ChunkKept
               | Heartbeat | SessionCell | InterruptCell | CellReport)
