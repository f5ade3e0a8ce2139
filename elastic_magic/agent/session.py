"""A session's agent: the job's agent kept alive between cells (design decision 15).

The group is formed as a job's is (rendezvous round, workers from the warm pool, torchrun's
environment), then waits: each cell is one payload that every rank runs in its persistent
namespace (``worker/session.py``). Between cells the agent blocks on its inbox (no polling):
a worker that dies while idle arrives there as its report pipe closing. A group that broke
(a rank died, or did not come back from an interrupt) fails the cell it broke in, naming
the rank (a cell the user interrupted comes back interrupted), and is re-formed before the
next cell: a new round, fresh workers, the setup cells replayed in order (a ``State`` they
make restores the last commit). Re-formations after a failure count against
``--max-restarts``; a resize does not. What to do is decided in ``policy``
(``during_cell``, ``cell_state``, ``reform_allowed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from collections import deque
from typing import Any

from ..events import (
    CellStarted,
    Event,
    MembershipChanged,
    Output,
    SessionBroken,
    SessionReformed,
    WorkerFailed,
)
from ..messages import Action, CellReport, Exit, Interrupt, Leaving, Run, StopCommand
from ..payload import Payload, build_payload
from ..result import (
    JobResult,
    JobState,
    RankFailure,
    assemble_result,
    root_cause_order,
    what_happened,
)
from ..spec import JobSpec
from ..worker import session as worker_session
from ..worker.session import CELL_END_MARK
from .cells import (
    CellRequest,
    InterruptCommand,
    OtherMachines,
    OutputEnded,
    SessionEndedError,
    session_payload,
    take_end_marks,
)
from .ending import close_group, finish
from .hub import FromLink
from .policy import CellStatus, CellStep, cell_state, during_cell, reform_allowed
from .roles import JoinedJob
from .status import StatusBoard
from .supervisor import Agent
from .workers import WorkerState, wait_for_exit

# Ranks still in the cell this long after an interrupt are stuck (a collective, C code).
INTERRUPT_GRACE = 5.0
NOT_BACK = f"did not come back within {INTERRUPT_GRACE:g}s of the interrupt"
# A rank that answered but whose output has not reached its end mark by then (it closed its
# stdout, say) is not waited for any longer.
OUTPUT_GRACE = 2.0
# Idle workers told to leave when the session ends exit within this, or are stopped.
EXIT_GRACE = 2.0
# Events that happen between cells (a rank dying), shown by the next cell; older ones go.
IDLE_EVENTS = 200


class SessionAgent(Agent):
    """Runs a session's cells on a group that outlives them; re-forms it when it breaks."""

    def __init__(self, spec: JobSpec, run_id: str, inbox: queue.Queue[Any],
                 board: StatusBoard, *, token: str | None = None,
                 joined: JoinedJob | None = None, ready: Payload | None = None) -> None:
        self.cell: CellRequest | None = None
        self.idle_events: deque[Event] = deque(maxlen=IDLE_EVENTS)
        # Forming a group runs this first: every rank is up once it answers.
        ready = ready or session_payload(build_payload(worker_session.assign, spec,
                                                       args=({},)))
        super().__init__(spec, ready, run_id, self._route, inbox, board, token=token,
                         joined=joined)
        self.others = OtherMachines()  # a multi-node session's other machines
        self.setup: list[Payload] = []
        self.broken: str | None = "the session starts"  # why the group must be formed
        self.pending: deque[CellRequest] = deque()
        self.ended: JobState | None = None
        self.interrupt = False  # the user interrupted the running cell
        self.stuck: tuple[int, ...] = ()  # ranks that did not come back from an interrupt
        self.marks: set[tuple[int, str]] = set()
        self.cell_started = time.time()

    # -- events ---------------------------------------------------------------------------

    def _route(self, event: Event) -> None:
        """Every event goes to the running cell, or waits for the next one. Called from
        output pumps too: end-of-cell marks are taken out of the lines here."""
        if isinstance(event, Output):
            kept = take_end_marks(event, self.inbox.put)
            if kept is None:
                return
            event = kept
        self._deliver(event)

    def _deliver(self, event: Event) -> None:
        cell = self.cell
        if cell is not None:
            cell.events.put(event)
        else:
            self.idle_events.append(event)

    # -- the session's life ---------------------------------------------------------------

    def run(self) -> JobResult:
        final = JobState.STOPPED
        try:
            self.open()
            self._reform()  # now: the first cell finds its workers ready
            while (request := self._next_cell()) is not None:
                self._serve_cell(request)
            final = self.ended or JobState.STOPPED
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            self._dismiss()
            for request in self.pending:  # cells queued behind the end
                request.outcome.set_exception(SessionEndedError(
                    f"the session {self.run_id} has ended; start a new one."))
            result = finish(self, final)
        return result

    def _next_cell(self) -> CellRequest | None:
        """Block until a cell comes (None: the session ends). A rank that dies meanwhile
        breaks the group at once, so that its peers do not wait for it."""
        while self.ended is None:
            if self.pending:
                return self.pending.popleft()
            if self._handle(self.inbox.get()) is Action.STOP:
                self.ended = JobState.STOPPED
            elif self.group is not None and self.broken is None and self._died():
                self._break_idle()
            elif self.broken is None and self.others.broken():
                close_group(self)
                self._break("a rank on another machine died while the session was idle",
                            self.others.failures())
        return None

    def _handle(self, item: Any) -> Action | None:
        match item:
            case CellRequest():
                self.pending.append(item)
                return None
            case InterruptCommand() if (self.cell is not None or self.pending) \
                    and self.state is JobState.RENDEZVOUS:
                # A cell waits for a round (for machines): only a stop ends that wait.
                return super()._handle(StopCommand("interrupted while the session formed"))
            case InterruptCommand():
                self.interrupt = self.cell is not None
                return None
            case OutputEnded(attempt, rank, stream):
                if self.group is not None and attempt == self.group.attempt:
                    self.marks.add((rank, stream))
                return None
            case FromLink(message=CellReport() as report):
                self.others.take(report)
                return None
            case FromLink(message=None | Leaving()) if self.others.expected:
                self.others.lost = True  # then what the role makes of it
        action = super()._handle(item)
        if action is Action.REGROUP and self.group is not None and self.broken is None \
                and not self.membership.resize_pending:  # a machine left: not a restart
            self.broken = "a machine left the session"
        return action

    def _serve_cell(self, request: CellRequest) -> None:
        self.cell = request
        self.cell_started = time.time()
        while self.idle_events:  # what happened since the last cell (pumps may add more)
            request.events.put(self.idle_events.popleft())
        try:
            result = self._run_cell(request)
        except BaseException as exc:
            request.outcome.set_exception(exc)
            raise
        finally:
            self.cell = None
        request.outcome.set_result(result)

    def _run_cell(self, request: CellRequest) -> JobResult:
        self._drain()  # a rank's death that is already known breaks the group first
        if self.group is not None and self.broken is None:
            self.group.poll()  # notes exits
            if self._died():
                self._break_idle()
        if self.ended is not None:
            return self._cell_result(self.ended, self.failures)
        if self.broken is not None or self.membership.resize_pending \
                or self._nodes_waiting():
            failures = self._reform()
            if failures is not None:
                return self._cell_result(self.ended or JobState.FAILED, failures)
        self._cell_started()
        step, failures = self._run_on_group(request.payload)
        while step is CellStep.RESIZED:  # every rank left at a commit: on, at the new size
            self.broken = "resize"
            failures = self._reform()
            if failures is not None:
                return self._cell_result(self.ended or JobState.FAILED, failures)
            step, failures = self._run_on_group(request.payload)
        if step is CellStep.STOP:
            self.ended = JobState.STOPPED
            return self._cell_result(JobState.STOPPED, [], self.stop_reason)
        state = cell_state(step, failures, interrupted=self.interrupt, stuck=self.stuck)
        if state is JobState.SUCCEEDED and request.setup:
            self.setup.append(request.payload)
        why = f"interrupted: {_not_back(self.stuck)}" if self.stuck else "interrupted"
        return self._cell_result(state, failures, why)

    def _cell_started(self) -> None:
        group, info = self.group, self.round
        assert group is not None and info is not None
        self.emit(CellStarted(group.attempt, group.ranks, info.world_size, info.nnodes,
                              info.round, self.restarts))

    # -- one payload on the group -----------------------------------------------------------

    def _run_on_group(self, payload: Payload | None) -> tuple[CellStep, list[RankFailure]]:
        """Send ``payload`` to every rank (None: it was sent when the group started) and
        wait for their answers; what ended the cell, and the ranks that failed."""
        group = self.group
        assert group is not None
        self.marks = set()
        self.interrupt = False
        self.stuck = ()
        for worker in group.workers:
            worker.result = worker.error = None
            worker.state = WorkerState.HEALTHY
            if payload is not None:
                worker.send(Run(payload))
        if payload is not None:
            self.others.send_cell(self.role, payload)
        self.set_state(JobState.RUNNING)
        interrupted_at: float | None = None
        answered_at: float | None = None
        while True:
            action = self._next_action(self.spec.monitor_interval)
            group.poll()  # notes exits
            answered = all(w.result is not None or w.error is not None
                           for w in group.workers) and self.others.answered()
            if answered and answered_at is None:
                answered_at = time.monotonic()
            ended = {(w.global_rank, s) for w in group.workers for s in ("stdout", "stderr")}
            status = CellStatus(
                died=self._died() or self.others.broken(),
                errors=any(w.error is not None for w in group.workers)
                or bool(self.others.failures()),
                resized=all(w.resized for w in group.workers),
                reported=answered and (ended <= self.marks or time.monotonic()
                                       - (answered_at or 0.0) > OUTPUT_GRACE))
            step = during_cell(
                action, status, interrupt=self.interrupt, grace=INTERRUPT_GRACE,
                interrupted_for=None if interrupted_at is None
                else time.monotonic() - interrupted_at)
            if step is CellStep.INTERRUPT:
                interrupted_at = time.monotonic()
                self._interrupt_running()
                self.others.interrupt(self.role)
                continue
            if step is CellStep.WAIT:
                continue
            break
        own = root_cause_order([w.failure() for w in group.workers if w.error is not None])
        if step is CellStep.DONE:
            self.set_state(JobState.IDLE)
            self._emit_failures(own)  # other machines send their own
            return step, root_cause_order([*own, *self.others.failures()])
        if step is CellStep.BROKEN:
            dead = self._dead_ranks()
            if not status.died:  # the interrupt's grace ran out
                self.stuck = tuple(w.global_rank for w in group.workers
                                   if w.result is None and w.error is None)
            failures = root_cause_order([*self._tear_down(self.stuck),
                                         *self.others.failures()])
            if self.others.broken():
                reason = "a rank on another machine died in the cell"
            elif self.stuck:
                reason = _not_back(self.stuck)
            else:
                reason = _death(failures, dead, "in the cell")
            self._break(reason, failures)
            return step, failures
        if step is CellStep.RESIZED:
            close_group(self)
        return step, own

    def _interrupt_running(self) -> None:
        for worker in self.group.workers if self.group else []:
            if worker.result is None and worker.error is None and worker.control is not None:
                with contextlib.suppress(OSError):  # gone: its pipe closing says so
                    worker.control.send(Interrupt())

    def _died(self) -> bool:
        return bool(self._dead_ranks())

    def _dead_ranks(self) -> set[int]:
        """This machine's ranks whose process has ended (but at a resize)."""
        return {w.global_rank for w in self.group.workers if w.ended_at is not None
                and not w.resized} if self.group is not None else set()

    def _emit_failures(self, failures: list[RankFailure]) -> None:
        for failure in failures:
            self.emit(WorkerFailed(failure))

    def _tear_down(self, stuck: tuple[int, ...] = ()) -> list[RankFailure]:
        """Stop the group at once; its failures, root cause first. ``stuck``: ranks that
        did not come back from an interrupt: consequences when a rank raised first (the
        interrupt was for it), else what broke the group."""
        group = self.group
        assert group is not None
        teardown_at = group.tear_down()
        self._drain()  # error reports still in flight
        failures = group.failures_before(teardown_at)
        raised = any(f.exc_type not in (None, "KeyboardInterrupt") for f in failures)
        failures += [dataclasses.replace(w.failure(), time=teardown_at, reason=NOT_BACK,
                                         consequence=raised)
                     for w in group.workers if w.global_rank in stuck]
        failures = self.hangs.explain(root_cause_order(failures))
        self._emit_failures(failures)
        close_group(self)
        return failures

    def _break_idle(self) -> None:
        """A rank died while no cell ran: the group is gone."""
        dead = self._dead_ranks()
        failures = self._tear_down()
        self._break(_death(failures, dead, "while the session was idle"), failures)

    def _break(self, reason: str, failures: list[RankFailure]) -> None:
        """The group is gone: re-form before the next cell, if a restart is left."""
        self.failures = failures
        reforms = reform_allowed(self.restarts, self.spec.max_restarts)
        if reforms:
            self.restarts += 1
            self.board.publish(restarts=self.restarts)
        else:
            self.ended = JobState.FAILED
        self.broken = reason
        self.emit(SessionBroken(reason, self.restarts, self.spec.max_restarts, reforms))
        self.set_state(JobState.RESTARTING if reforms else JobState.FAILED)

    # -- forming the group ----------------------------------------------------------------

    def _reform(self) -> list[RankFailure] | None:
        """New round, fresh workers, setup cells replayed (a State restores the last
        commit). None once the group is up; else why not (failures, or none: stopped)."""
        if self.ended is not None:
            return self.failures
        first = self.attempt < 0
        close_group(self)
        if not first:  # the other machines leave their groups for the new round too
            self.role.regrouping()
        if change := self.membership.apply():
            self.emit(MembershipChanged(*change))
        self.set_state(JobState.RENDEZVOUS)
        info = self._next_round()
        if info is None:
            self.ended = JobState.STOPPED
            return []
        self._start_group(info)
        self.others.new_round(info)
        for payload in [None, *self.setup]:  # None: the ready payload, sent at the start
            step, failures = self._run_on_group(payload)
            if step is CellStep.STOP:
                self.ended = JobState.STOPPED
                return []
            if step is not CellStep.DONE or failures:
                if step is CellStep.DONE:  # a setup cell failed: this group cannot go on
                    close_group(self)
                    self._break("a setup cell failed when it was replayed", failures)
                return failures
        self.broken = None
        if not first:
            step_ = (self.snapshots.meta or {}).get("step")
            self.emit(SessionReformed(len(self.setup), step_, self.world_size))
        return None

    def _dismiss(self) -> None:
        """The session ends: idle workers leave on their own (their process group closes
        cleanly); ``_finish`` stops any still there."""
        group = self.group
        if group is None:
            return
        self._interrupt_running()
        for worker in group.workers:
            worker.send(Exit())
        wait_for_exit(group.workers, EXIT_GRACE)

    def _cell_result(self, state: JobState, failures: list[RankFailure],
                     reason: str | None = None) -> JobResult:
        group = self.group
        tails = {rank: [text for line in lines if (text := line.replace(CELL_END_MARK, ""))]
                 for rank, lines in (group.tails() if group else {}).items()}
        return assemble_result(
            run_id=self.run_id, state=state, world_size=self.world_size,
            restarts=self.restarts, max_restarts=self.spec.max_restarts,
            started=self.cell_started, log_dir=self.log_root,
            failures=failures, stop_reason=reason or "the session ended",
            resizes=self.membership.resizes, commit=self.snapshots.meta, snapshot=None,
            ranks={**group.results(), **self.others.results()}
            if group and state is JobState.SUCCEEDED else {},
            tails=tails)


def _not_back(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {NOT_BACK}"


def _death(failures: list[RankFailure], dead: set[int], when: str) -> str:
    """Why the group broke: the first rank that died, and what it did."""
    root = next((f for f in failures if f.rank in dead), None)
    if root is None:
        return f"a rank died {when}"
    return what_happened(root) + ("" if root.reason else f" {when}")
