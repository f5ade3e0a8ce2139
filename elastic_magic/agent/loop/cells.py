"""A session's cells: where their events go, the end-of-cell marks on the ranks' output, and
what the other machines of a multi-node session report. The head's agent sends each cell
(and each setup cell it replays) to the other machines as :class:`SessionCell` and waits for
their :class:`CellReport` as it waits for its own ranks (``OtherMachines``)."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...events import Event, Output
from ...messages import CellReport, InterruptCell, Result, SessionCell
from ...payload import Payload
from ...result import RankFailure
from ...worker.session import CELL_END_MARK
from ..inbox import CellRequest, Inbox, OutputEnded

if TYPE_CHECKING:
    from ..machines.roles import SingleMachine
    from ..rounds import RoundInfo

# Events that happen between cells (a rank dying), shown by the next cell; older ones go.
IDLE_EVENTS = 200


class SessionEndedError(RuntimeError):
    """The session has ended (stopped, or its restarts were spent)."""


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


class OtherMachines:
    """The head's view of the other machines for the cell that runs: their reports."""

    def __init__(self, role: SingleMachine) -> None:
        self.role = role  # the head's tells the machines that joined it
        self.round_id: str | None = None
        self.expected = 0
        self.seq = 0
        self.reports: dict[int, CellReport] = {}  # node rank -> report of cell ``seq``
        self.idle_break: CellReport | None = None  # a rank there died between cells
        self.lost = False  # a machine left or its link failed: its report may never come

    def new_round(self, info: RoundInfo) -> None:
        self.round_id, self.expected, self.seq = info.round_id, info.nnodes - 1, 0
        self.reports, self.idle_break, self.lost = {}, None, False

    def send_cell(self, payload: Payload) -> None:
        self.seq += 1
        self.reports = {}
        if self.expected and self.round_id is not None:
            self.role.broadcast(SessionCell(self.round_id, self.seq, payload))

    def interrupt(self) -> None:
        if self.expected and self.round_id is not None:
            self.role.broadcast(InterruptCell(self.round_id, self.seq))

    def note(self, report: CellReport) -> None:
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


class CellEvents:
    """A session's events (the engine's ``emit``; the output pumps call it too): each goes
    to the running cell, or waits for the next one (a rank may die between cells); on a
    machine that joined, each is forwarded to the head instead. End-of-cell marks are taken
    out of output lines here and posted to the inbox (:class:`OutputEnded`)."""

    def __init__(self, inbox: Inbox, forward: Callable[[Event], None] | None = None) -> None:
        self.inbox = inbox
        self.forward = forward
        self.cell: CellRequest | None = None
        self.idle: deque[Event] = deque(maxlen=IDLE_EVENTS)

    def route(self, event: Event) -> None:
        if isinstance(event, Output):
            kept = take_end_marks(event, self.inbox.put)
            if kept is None:
                return
            event = kept
        cell = self.cell
        if self.forward is not None:
            self.forward(event)  # the notebook shows it; nothing is kept here
        elif cell is not None:
            cell.events.put(event)
        else:
            self.idle.append(event)

    def begin(self, cell: CellRequest) -> None:
        """``cell`` runs: what happened since the last one goes first."""
        self.cell = cell
        while self.idle:  # the pumps may add more meanwhile
            cell.events.put(self.idle.popleft())

    def end(self) -> None:
        self.cell = None


def without_end_marks(tails: dict[int, list[str]]) -> dict[int, list[str]]:
    """Output tails without the end-of-cell marks (a line that was only a mark goes)."""
    return {rank: [line.replace(CELL_END_MARK, "") for line in lines if line != CELL_END_MARK]
            for rank, lines in tails.items()}
