"""What a detached job's agent and the kernels attached to it say to each other, in signed
frames over a unix socket that only the user can reach (``agent/handles/detached_agent``).

The agent sends each attaching kernel the job as it stands (``Welcome``), then what happens
(``NewEvents``, ``StatusChanged``) and, once, how it ended (``Ended``). A kernel sends
commands (``Command``, ``StacksAsked``, ``ScaleNodes``) and says when it has the result
(``ResultTaken``), after which the agent leaves nothing behind."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..result import JobResult
from ..spec import JobSpec
from .events import Event
from .messages import ScaleCommand, StopCommand


@dataclass(frozen=True)
class Welcome:
    """The job as it stands when a kernel attaches: its events so far (each rank's output
    as its tail: the rest is in the logs) and its status board's fields."""

    run_id: str
    spec: JobSpec
    history: tuple[Event, ...]
    status: dict[str, Any]
    lines_left_out: int  # output lines not in ``history`` (in the run's logs)


@dataclass(frozen=True)
class NewEvents:
    """What the job did since the last message, in order."""

    events: tuple[Event, ...]


@dataclass(frozen=True)
class StatusChanged:
    """The status board's fields that changed."""

    fields: dict[str, Any]


@dataclass(frozen=True)
class Ended:
    """The job's end: its result, or the agent's own failure (as text)."""

    result: JobResult | None
    error: str | None = None


@dataclass(frozen=True)
class StacksAnswer:
    """Every rank's stacks, for the kernel's request number ``request``."""

    request: int
    stacks: dict[int, str]


@dataclass(frozen=True)
class Command:
    """Stop or resize, as the kernel's ``Job.stop``/``scale`` ask."""

    command: StopCommand | ScaleCommand


@dataclass(frozen=True)
class StacksAsked:
    """Gather every rank's stacks (``Job.stacks``); answered with ``StacksAnswer``."""

    request: int


@dataclass(frozen=True)
class ScaleNodes:
    """Ask the job's launcher for ``nnodes`` machines in all (``Job.scale_nodes``)."""

    nnodes: int


@dataclass(frozen=True)
class ResultTaken:
    """The kernel has the result: the agent may go."""


ToKernel = Welcome | NewEvents | StatusChanged | Ended | StacksAnswer
ToAgent = Command | StacksAsked | ScaleNodes | ResultTaken
