"""Hangs, seen from the agent: each rank's last progress, the stall watchdog
(``--stall-timeout``), ranks that finish while others run, and the root cause of a failure
that is only a timeout or a lost peer.

It runs on the agent thread, beside the loop: the engine hands it the workers' reports, the
loop asks it each round whether the group must fail (``watch`` for a job, ``stalled`` for a
session's cell) and lets it explain the failures after a teardown (``explain``). The stacks
it judges by are gathered by ``stack_requests``; the decisions themselves are pure functions
in ``stalls``.
"""

from __future__ import annotations

import dataclasses
import time

from ...result import RankFailure, is_consequence, root_cause_order
from ...spec import JobSpec
from ...stacks import place_of
from ...wire.events import Event, EventSink, Output, RanksFinished
from ...wire.messages import (
    Commit,
    CommitIntent,
    CommitTarget,
    Progress,
    Result,
    Running,
    StateGet,
)
from ..inbox import WorkerReport
from ..node.group import WorkerGroup
from ..node.workers import WorkerState
from ..policy import GroupStatus
from .stack_requests import NOT_ANSWERING, Gathering, StackRequests
from .stalls import (
    HangDiagnosis,
    HangKind,
    RankView,
    cause_reason,
    judge_failure,
    judge_stall,
    quiet_ranks,
    waiting_reason,
)

FINISHED_NOTICE = 1.0  # a rank done this long before the others is news


class HangWatch:
    """One job's hang diagnosis on this machine, on the agent thread. Per group (and per
    session cell): each rank's last progress, when it finished, the stacks asked for a
    decision and the verdict."""

    def __init__(self, spec: JobSpec, emit: EventSink, stacks: StackRequests) -> None:
        self.stall_timeout = spec.stall_timeout
        # Every rank here waiting in a collective names no one on several machines: the
        # ranks they wait for may be busy elsewhere, where that machine's agent watches them.
        self.all_waiting_after = float("inf") if spec.multi_node \
            else (spec.stall_timeout or 0.0)
        self.emit = emit
        self.stacks = stacks
        self._output_at: dict[tuple[int, int], float] = {}  # (attempt, rank), pump threads
        self.reset(-1)

    def reset(self, attempt: int) -> None:
        """A new group, or a session's next cell: nothing known of its ranks yet."""
        self.attempt = attempt
        self.progress_at: dict[int, float] = {}  # local rank -> last progress
        self.finished_at: dict[int, float] = {}
        self.noticed: set[int] = set()  # finished ranks already reported as news
        self.check: Gathering | None = None  # stacks asked for a decision
        self.next_check = 0.0
        self.verdict: HangDiagnosis | None = None
        self.tripped = False  # the watchdog failed the group
        self.failures: list[RankFailure] = []  # the verdict's, to put before the reports
        self.kept: dict[int, str] = {}  # stacks of a group that failed by a hang

    def _sync(self, group: WorkerGroup) -> None:
        if group.attempt != self.attempt:
            self.reset(group.attempt)

    # -- what arrives ---------------------------------------------------------------------

    def noting_output(self, emit: EventSink) -> EventSink:
        """``emit`` for the output pumps: a printed line is progress too."""
        def sink(event: Event) -> None:
            if isinstance(event, Output):
                self._output_at[(event.attempt, event.rank)] = event.time
            emit(event)
        return sink

    def note(self, report: WorkerReport, group: WorkerGroup) -> bool:
        """Note a worker's progress or result; True when the report was for us alone."""
        self._sync(group)
        if report.attempt == group.attempt:
            match report.message:
                case (Progress() | Running() | StateGet() | Commit() | CommitIntent()
                      | CommitTarget()):
                    self.progress_at[report.local_rank] = report.time
                case Result():
                    self.finished_at[report.local_rank] = report.time
        return isinstance(report.message, Progress)

    # -- each round of the loop -----------------------------------------------------------

    def watch(self, status: GroupStatus, group: WorkerGroup) -> GroupStatus:
        """A job's group status as the loop should see it: failed when the watchdog names a
        stalled rank; not failed yet while the stacks of a group that failed by a timeout
        or a lost peer are being gathered (the teardown waits for them, ~ms; at most
        STACKS_DEADLINE)."""
        now = self._look(group)
        self._notice_finished(group, now)
        if self.tripped:
            return dataclasses.replace(status, failed=True)
        if status.failed:
            if self.verdict is None and _hang_failure(group) and not self._judged(group, now):
                return dataclasses.replace(status, failed=False)
            return status
        if self.stall_timeout is not None and self._stall(group, now):
            return dataclasses.replace(status, failed=True)
        return status

    def stalled(self, group: WorkerGroup) -> bool:
        """A session's cell: whether the watchdog names a stalled rank (then the group is
        torn down, and ``explain`` names it)."""
        now = self._look(group)  # stacks asked for meanwhile get their answers, or time out
        if self.stall_timeout is None:
            return False
        return self.tripped or self._stall(group, now)

    def _look(self, group: WorkerGroup) -> float:
        now = time.time()
        self._sync(group)
        self.stacks.drop_gone(group)
        self.stacks.tick(now)
        return now

    def _notice_finished(self, group: WorkerGroup, now: float) -> None:
        for worker in group.workers:
            if worker.state is WorkerState.SUCCEEDED:
                self.finished_at.setdefault(worker.local_rank, now)
        running = tuple(w.global_rank for w in group.workers
                        if w.state is WorkerState.HEALTHY and not w.resized)
        due = [w for w in group.workers if w.local_rank in self.finished_at
               and w.local_rank not in self.noticed
               and now - self.finished_at[w.local_rank] >= FINISHED_NOTICE]
        if running and due:
            self.noticed.update(w.local_rank for w in due)
            self.emit(RanksFinished(tuple(w.global_rank for w in due), running))

    def _judged(self, group: WorkerGroup, now: float) -> bool:
        """A failure by timeout or lost peer: once the live ranks' stacks are in, name the
        rank the others waited for. False while they are still being gathered."""
        if self.check is None:
            self.check = self.stacks.gather(group, None)
        if not self.check.done:
            return False
        views = self._views(group, now, self.check)
        timed_out = tuple(w.global_rank for w in group.workers if w.error is not None)
        self._decide(judge_failure(views, timed_out), views, group, self.check, now)
        return True

    def _stall(self, group: WorkerGroup, now: float) -> bool:
        """The watchdog: True when it names a rank and the group must fail."""
        assert self.stall_timeout is not None
        if self.check is None:
            if now < self.next_check or not quiet_ranks(self._views(group, now, None),
                                                        self.stall_timeout):
                return False
            self.check = self.stacks.gather(group, None)
        if not self.check.done:
            return False
        views = self._views(group, now, self.check)
        verdict = judge_stall(views, self.stall_timeout, self.all_waiting_after)
        if verdict.kind is HangKind.NONE:  # someone still works: look again a little later
            self.check = None
            self.next_check = now + max(1.0, self.stall_timeout / 2)
            return False
        self._decide(verdict, views, group, self.check, now)
        self.tripped = True
        return True

    def _views(self, group: WorkerGroup, now: float,
               check: Gathering | None) -> list[RankView]:
        views = []
        for worker in group.workers:
            local, rank = worker.local_rank, worker.global_rank
            finished = worker.state is WorkerState.SUCCEEDED
            if not worker.running or worker.resized or not (
                    finished or (worker.state is WorkerState.HEALTHY and worker.alive())):
                continue  # not started, left, failed or gone: the group's own checks see it
            if check is not None and not finished and rank not in check.stacks:
                continue  # not asked: it had already failed
            last = max(self.progress_at.get(local, now),
                       self._output_at.get((worker.attempt, rank), 0.0))
            place = place_of(check.stacks[rank]) if check and rank in check.stacks \
                and not finished else None
            views.append(RankView(rank, max(0.0, now - last), finished, place))
        return views

    def _decide(self, verdict: HangDiagnosis, views: list[RankView], group: WorkerGroup,
                check: Gathering, now: float) -> None:
        """Keep the stacks, and the failures that name the verdict's ranks."""
        self.verdict = verdict
        self.kept = {rank: stacks.format() for rank, stacks in check.stacks.items()
                     if stacks.threads or stacks.note == NOT_ANSWERING}
        by_rank = {v.rank: v for v in views}
        places = {v.rank: v.place for v in views if v.place is not None}
        workers = {w.global_rank: w for w in group.workers}
        self.failures = []
        for rank in verdict.causes:
            view, worker = by_rank[rank], workers[rank]
            main = check.stacks[rank].main if rank in check.stacks else None
            left = verdict.kind is HangKind.LEFT_EARLY
            when = self.finished_at.get(worker.local_rank, now) if left \
                else now - view.quiet_for
            self.failures.append(dataclasses.replace(
                worker.failure(), time=when, reason=cause_reason(verdict, view, places),
                traceback="" if left or main is None else main.format(),
                cell_line=None if left or view.place is None else view.place.cell_line,
                source_line=None if left or view.place is None else
                view.place.source_line or None))
        for rank in verdict.waiting:
            if rank in verdict.causes or rank not in by_rank:  # it reported its own failure
                continue
            view, worker = by_rank[rank], workers[rank]
            place = view.place
            self.failures.append(dataclasses.replace(
                worker.failure(), time=now - view.quiet_for, reason=waiting_reason(place),
                consequence=True, cell_line=place.cell_line if place else None,
                source_line=(place.source_line or None) if place else None))

    def explain(self, reported: list[RankFailure]) -> list[RankFailure]:
        """After the teardown: the verdict's root cause first, then what the ranks reported
        (their timeouts and lost peers are consequences), then the ranks that only waited."""
        if not self.failures:
            return reported
        causes = [f for f in self.failures if not f.consequence]
        named = {f.rank for f in causes}
        rest = [f for f in reported if f.rank not in named]
        told = {f.rank for f in rest}
        waited = [f for f in self.failures if f.consequence and f.rank not in told]
        return [*causes, *root_cause_order(rest), *waited]


def _hang_failure(group: WorkerGroup) -> bool:
    """Every rank that failed so far reported a timeout or a lost peer: the cause is a rank
    still alive (stuck, or returned early), whose stacks tell. Not while a rank's report
    pipe has closed without a word, or its process is gone before that shows: it died,
    and its exit (seen moments later, from its shepherd) names it; a peer that lost it
    may report first."""
    if any(w.result is None and w.error is None and (
            w.channel_closed_at is not None or (w.ended_at is None and w.process_gone()))
           for w in group.workers):
        return False
    failed = [w for w in group.workers if w.error is not None or (
        w.exited_at is not None and w.exit_code() not in (0, None))]
    return bool(failed) and all(w.error is not None and is_consequence(w.failure())
                                for w in failed)
