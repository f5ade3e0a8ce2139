"""A session's cells: what the kernel asks of a session's agent, and what the other machines
of a multi-node session report. The head's agent sends each cell (and each setup cell it
replays) to the other machines as :class:`SessionCell` and waits for their
:class:`CellReport` as it waits for its own ranks (``OtherMachines``)."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..events import Event, Output
from ..messages import CellReport, InterruptCell, LinkMessage, Result, SessionCell
from ..payload import Payload
from ..result import JobResult, RankFailure
from ..worker.session import CELL_END_MARK

if TYPE_CHECKING:
    from .rendezvous import RoundInfo
    from .roles import SingleMachine


class SessionEndedError(RuntimeError):
    """The session has ended (stopped, or its restarts were spent)."""


@dataclass
class CellRequest:
    """One cell for the session: its payload, and where its events and result go."""

    payload: Payload
    setup: bool = False
    events: queue.Queue[Event] = field(default_factory=queue.Queue)
    outcome: Future[JobResult] = field(default_factory=Future)


@dataclass(frozen=True)
class InterruptCommand:
    """Ctrl-C in the kernel: KeyboardInterrupt in every rank's running code."""


@dataclass(frozen=True)
class OutputEnded:
    """A rank's stream reached the end-of-cell mark (posted by the output router)."""

    attempt: int
    rank: int
    stream: str


def take_end_marks(event: Output, ended: Callable[[OutputEnded], None]) -> Output | None:
    """``event`` without the end-of-cell marks in its lines (None: nothing else was in
    it); ``ended`` is told of each mark."""
    if not any(line.endswith(CELL_END_MARK) for line in event.lines):
        return event
    lines = []
    for line in event.lines:
        if line.endswith(CELL_END_MARK):
            ended(OutputEnded(event.attempt, event.rank, event.stream))
            line = line[:-len(CELL_END_MARK)]
            if not line:
                continue  # the mark alone: not a line of the cell's
        lines.append(line)
    return dataclasses.replace(event, lines=tuple(lines)) if lines else None


def session_payload(payload: Payload) -> Payload:
    return dataclasses.replace(payload, session=True)


def _broadcast(role: SingleMachine, message: LinkMessage) -> None:
    hub = getattr(role, "hub", None)  # the head's; one machine alone has none
    if hub is not None:
        hub.broadcast(message)


class OtherMachines:
    """The head's view of the other machines for the cell that runs: their reports."""

    def __init__(self) -> None:
        self.round_id: str | None = None
        self.expected = 0
        self.seq = 0
        self.reports: dict[int, CellReport] = {}  # node rank -> report of cell ``seq``
        self.idle_break: CellReport | None = None  # a rank there died between cells
        self.lost = False  # a machine left or its link failed: its report may never come

    def new_round(self, info: RoundInfo) -> None:
        self.round_id, self.expected, self.seq = info.round_id, info.nnodes - 1, 0
        self.reports, self.idle_break, self.lost = {}, None, False

    def send_cell(self, role: SingleMachine, payload: Payload) -> None:
        self.seq += 1
        self.reports = {}
        if self.expected and self.round_id is not None:
            _broadcast(role, SessionCell(self.round_id, self.seq, payload))

    def interrupt(self, role: SingleMachine) -> None:
        if self.expected and self.round_id is not None:
            _broadcast(role, InterruptCell(self.round_id, self.seq))

    def take(self, report: CellReport) -> None:
        if report.round_id != self.round_id:
            return  # an earlier round's
        if report.seq == -1:
            self.idle_break = report
        elif report.seq == self.seq:
            self.reports[report.node_rank] = report

    def answered(self) -> bool:
        return len(self.reports) >= self.expected

    def broken(self) -> bool:
        return self.lost or self.idle_break is not None \
            or any(r.broken for r in self.reports.values())

    def failures(self) -> list[RankFailure]:
        reports = [*self.reports.values(), *([self.idle_break] if self.idle_break else [])]
        return [f for report in reports for f in report.failures]

    def results(self) -> dict[int, Result]:
        return {rank: result for report in self.reports.values()
                for rank, result in report.results.items()}
