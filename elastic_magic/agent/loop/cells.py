"""A session's cells: where their events go, the end-of-cell marks on the ranks' output, and
what the other machines of a multi-node session report. The head's agent sends each cell
(and each setup cell it replays) to the other machines as :class:`SessionCell` and waits for
their :class:`CellReport` as it waits for its own ranks (``OtherMachines``)."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...result import RankFailure
from ...wire.events import Event, Output
from ...wire.link_messages import CellReport, InterruptCell, SessionCell
from ...wire.messages import Result
from ...wire.metrics import Logged
from ...wire.payload import Payload
from ..inbox import CellRequest, Inbox, OutputEnded

if TYPE_CHECKING:
    from ..machines.roles import SingleMachine
    from ..round_info import RoundInfo

# Events that happen between cells (a rank dying), shown by the next cell; older ones go.
IDLE_EVENTS = 200


class SessionEndedError(RuntimeError):
    """The session has ended (stopped, or its restarts were spent)."""


def take_end_marks(event: Output, ended: Callable[[OutputEnded], None]) -> Output | None:
    """``event`` without its end-of-cell flag (None: it had no lines); ``ended`` is told
    of the end. The rank's output pump sets the flag for the rank's nonced mark only, so
    no line the cell printed ends it."""
    if not event.cell_end:
        return event
    ended(OutputEnded(event.attempt, event.rank, event.stream))
    return dataclasses.replace(event, cell_end=False) if event.lines else None


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

    def send_cell(self, payload: Payload, ranks: tuple[int, ...] | None = None) -> None:
        """To every other machine, for its ranks among ``ranks`` (None: all of them)."""
        self.seq += 1
        self.reports = {}
        if self.expected and self.round_id is not None:
            self.role.broadcast(SessionCell(self.round_id, self.seq, payload, ranks))

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
    machine that joined, each is forwarded to the head instead. The ends of cells' output
    are posted to the inbox here (:class:`OutputEnded`)."""

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
        elif not isinstance(event, Logged):  # between cells: a death must not be pushed out
            self.idle.append(event)

    def begin(self, cell: CellRequest) -> None:
        """``cell`` runs: what happened since the last one goes first."""
        self.cell = cell
        while self.idle:  # the pumps may add more meanwhile
            cell.events.put(self.idle.popleft())

    def end(self) -> None:
        self.cell = None

