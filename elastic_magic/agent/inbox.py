"""What arrives on an agent's inbox, in one place (as ``link_messages.LinkMessage`` is for links):
commands from the kernel's threads, reports from this machine's workers, messages from other
machines, a session's cells and the marks its output router posts. The agent's thread is the
only reader; anyone may put."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from ..result import JobResult
from ..wire.events import Event
from ..wire.link_messages import LinkMessage
from ..wire.messages import ScaleCommand, StacksCommand, StopCommand, WorkerMessage
from ..wire.payload import Payload


@dataclass(frozen=True)
class WorkerReport:
    """A message from a worker of ``attempt``, or None when its report pipe closed (told
    again with ``ended``, its wait status, once its shepherd has told how it ended, and
    ``time`` then when the shepherd reaped it)."""

    attempt: int
    local_rank: int
    message: WorkerMessage | None
    time: float
    ended: int | None = None


class LinkEnd(Protocol):
    """This side of a link to another machine, as a message from it is answered."""

    peer: str

    def send(self, message: LinkMessage) -> bool: ...


@dataclass(frozen=True)
class FromLink:
    """A message from the other side (machine ``node``, or 0 for the head), or None when
    the connection ended (``reason`` says why when it failed rather than closed)."""

    link: LinkEnd
    node: int
    message: LinkMessage | None
    reason: str | None = None


@dataclass
class CellRequest:
    """One cell for a session: its payload, and where its events and result go."""

    payload: Payload
    setup: bool = False
    events: queue.Queue[Event] = field(default_factory=queue.Queue)
    outcome: Future[JobResult] = field(default_factory=Future)


@dataclass(frozen=True)
class InterruptCommand:
    """Ctrl-C in the kernel: KeyboardInterrupt in every rank's running code (a session)."""


@dataclass(frozen=True)
class OutputEnded:
    """A rank's stream reached the end-of-cell mark (posted by a session's output router)."""

    attempt: int
    rank: int
    stream: str


InboxItem = (StopCommand | ScaleCommand | StacksCommand | WorkerReport
             | FromLink | CellRequest | InterruptCommand | OutputEnded)

Inbox = queue.Queue[InboxItem]
