"""Hangs, seen from the agent: each rank's last progress, its stacks on request, the stall
watchdog (``--stall-timeout``), ranks that finish while others run, and the root cause of a
failure that is only a timeout or a lost peer.

It runs on the agent thread, beside the loop: the loop hands it reports and commands, asks
it each round whether the group must fail (``watch``) and lets it explain the failures after
a teardown (``explain``). The decisions themselves are pure functions in ``stalls``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field

from ..events import Event, EventSink, Output, RanksFinished
from ..messages import (
    Commit,
    DumpStacks,
    NodeStacks,
    Progress,
    Result,
    Running,
    Stacks,
    StacksCommand,
    StacksRequest,
    StateGet,
)
from ..result import RankFailure, is_consequence, root_cause_order
from ..spec import JobSpec
from ..stacks import RankStacks, place_of
from .group import WorkerGroup
from .hub import FromLink
from .policy import GroupStatus
from .roles import Head, SingleMachine
from .stalls import (
    Kind,
    RankView,
    Verdict,
    cause_reason,
    judge_failure,
    judge_stall,
    quiet_ranks,
    waiting_reason,
)
from .workers import Worker, WorkerReport, WorkerState

STACKS_DEADLINE = 2.0  # a rank that has not sent its stacks by then is reported as silent
REMOTE_DEADLINE = 4.0  # other machines first gather their own ranks' stacks
FINISHED_NOTICE = 1.0  # a rank done this long before the others is news
NOT_ANSWERING = (f"did not answer within {STACKS_DEADLINE:.0f}s (stuck in C code that holds "
                 "the GIL?)")
FINISHED = "finished: its cell returned; it waits for the other ranks"
EXITED = "exited before it could answer"


@dataclass
class Gathering:
    """Stacks asked of this machine's ranks (and of other machines), kept until all have
    answered or the deadline passed."""

    request_id: int
    deadline: float
    asked: dict[tuple[int, int], int]  # (attempt, local rank) -> global rank, unanswered
    nodes: set[int]  # other machines (hub connections) that have not answered
    on_done: Callable[[Gathering], None] | None = None
    stacks: dict[int, RankStacks] = field(default_factory=dict)  # this machine's ranks
    remote: dict[int, str] = field(default_factory=dict)  # other machines' ranks, as text
    done: bool = False

    def complete(self, now: float) -> bool:
        return (not self.asked and not self.nodes) or now >= self.deadline

    def finish(self) -> None:
        for rank in self.asked.values():
            self.stacks[rank] = RankStacks(rank, note=NOT_ANSWERING)
        self.asked.clear()
        self.done = True
        if self.on_done is not None:
            self.on_done(self)

    def texts(self) -> dict[int, str]:
        found = {rank: stacks.format() for rank, stacks in self.stacks.items()}
        return dict(sorted({**found, **self.remote}.items()))


def _ask(worker: Worker, message: DumpStacks) -> bool:
    if worker.control is None:
        return False
    try:
        worker.control.send(message)
        return True
    except OSError:
        return False


class HangWatch:
    """One job's hang diagnosis on this machine, on the agent thread. Per group: each rank's
    last progress, when it finished, the stacks asked for a decision and the verdict."""

    def __init__(self, spec: JobSpec, emit: EventSink, role: SingleMachine) -> None:
        self.stall_timeout = spec.stall_timeout
        # Every rank here waiting in a collective names no one on several machines: the
        # ranks they wait for may be busy elsewhere, where that machine's agent watches them.
        self.all_waiting_after = float("inf") if spec.multi_node \
            else (spec.stall_timeout or 0.0)
        self.emit = emit
        self.role = role
        self._ids = itertools.count(1)
        self.gatherings: dict[int, Gathering] = {}
        self._output_at: dict[tuple[int, int], float] = {}  # (attempt, rank), pump threads
        self._reset(-1)

    def _reset(self, attempt: int) -> None:
        """A new group: nothing known of its ranks yet."""
        self.attempt = attempt
        self.progress_at: dict[int, float] = {}  # local rank -> last progress
        self.finished_at: dict[int, float] = {}
        self.noticed: set[int] = set()  # finished ranks already reported as news
        self.check: Gathering | None = None  # stacks asked for a decision
        self.next_check = 0.0
        self.verdict: Verdict | None = None
        self.stalled = False  # the watchdog failed the group
        self.failures: list[RankFailure] = []  # the verdict's, to put before the reports
        self.kept: dict[int, str] = {}  # stacks of a group that failed by a hang

    def _sync(self, group: WorkerGroup) -> None:
        if group.attempt != self.attempt:
            self._reset(group.attempt)

    # -- what arrives ---------------------------------------------------------------------

    def noting_output(self, emit: EventSink) -> EventSink:
        """``emit`` for the output pumps: a printed line is progress too."""
        def sink(event: Event) -> None:
            if isinstance(event, Output):
                self._output_at[(event.attempt, event.rank)] = event.time
            emit(event)
        return sink

    def handle(self, item: object, group: WorkerGroup | None) -> bool:
        """Take what arrived on the agent's inbox if it is ours alone (stacks asked or
        answered, progress); other reports are noted and left to the loop (False)."""
        match item:
            case StacksCommand():
                self.request(item, group)
                return True
            case WorkerReport() if group is not None:
                return self.take(item, group)
            case FromLink():
                return self.take_link(item, group)
        return False

    def take(self, report: WorkerReport, group: WorkerGroup) -> bool:
        """Note a worker's report; True when it was for us alone (progress, stacks)."""
        self._sync(group)
        mine = isinstance(report.message, (Progress, Stacks))
        if report.attempt != group.attempt:
            return mine
        local = report.local_rank
        match report.message:
            case Progress() | Running() | StateGet() | Commit():
                self.progress_at[local] = report.time
            case Result():
                self.finished_at[local] = report.time
            case Stacks(request_id, threads):
                gathering = self.gatherings.get(request_id)
                rank = gathering.asked.pop((report.attempt, local), None) if gathering else None
                if gathering is not None and rank is not None:
                    gathering.stacks[rank] = RankStacks(rank, threads)
                self._tick(time.time())
        return mine

    def take_link(self, item: FromLink, group: WorkerGroup | None) -> bool:
        """Stacks between machines; True when ``item`` was one of those."""
        match item.message:
            case StacksRequest(request_id):  # the head asks this machine
                link = item.link

                def answer(gathering: Gathering) -> None:
                    link.send(NodeStacks(request_id, gathering.texts()))

                self._start(group, answer)
            case NodeStacks(request_id, stacks):  # a machine answers the head
                gathering = self.gatherings.get(request_id)
                if gathering is not None:
                    gathering.remote.update(stacks)
                    gathering.nodes.discard(item.node)
                self._tick(time.time())
            case _:
                return False
        return True

    def request(self, command: StacksCommand, group: WorkerGroup | None) -> None:
        """Someone asked for every rank's stacks (``Job.stacks``)."""
        answer = command.answer

        def reply(gathering: Gathering) -> None:
            with contextlib.suppress(InvalidStateError):  # the asker gave up
                answer.set_result(gathering.texts())

        role = self.role
        nodes = set(role.names) if isinstance(role, Head) and role.hub is not None else set()
        gathering = self._start(group, reply, nodes=nodes)
        if nodes and isinstance(role, Head) and role.hub is not None:
            role.hub.broadcast(StacksRequest(gathering.request_id))

    def _start(self, group: WorkerGroup | None, on_done: Callable[[Gathering], None] | None,
               *, nodes: set[int] | None = None) -> Gathering:
        now = time.time()
        gathering = Gathering(next(self._ids), now + (REMOTE_DEADLINE if nodes else
                                                      STACKS_DEADLINE), {}, set(nodes or ()),
                              on_done)
        for worker in group.workers if group is not None else ():
            rank = worker.global_rank
            if worker.state is WorkerState.SUCCEEDED:
                gathering.stacks[rank] = RankStacks(rank, note=FINISHED)
            elif worker.error is None and worker.alive() \
                    and _ask(worker, DumpStacks(gathering.request_id)):
                gathering.asked[(worker.attempt, worker.local_rank)] = rank
        self.gatherings[gathering.request_id] = gathering
        self._tick(now)
        return gathering

    def _tick(self, now: float) -> None:
        for request_id, gathering in list(self.gatherings.items()):
            if gathering.complete(now):
                del self.gatherings[request_id]
                gathering.finish()

    def close(self) -> None:
        """The job ends: answer whoever still waits with what has arrived."""
        self._tick(float("inf"))

    # -- each round of the loop -----------------------------------------------------------

    def watch(self, status: GroupStatus, group: WorkerGroup) -> GroupStatus:
        """The group's status as the loop should see it: failed when the watchdog names a
        stalled rank; not failed yet while the stacks of a group that failed by a timeout
        or a lost peer are being gathered (the teardown waits for them, ~ms; at most
        STACKS_DEADLINE)."""
        now = time.time()
        self._sync(group)
        self._drop_gone(group)
        self._tick(now)
        self._notice_finished(group, now)
        if self.stalled:
            return dataclasses.replace(status, failed=True)
        if status.failed:
            if self.verdict is None and _hang_failure(group) and not self._judged(group, now):
                return dataclasses.replace(status, failed=False)
            return status
        if self.stall_timeout is not None and self._stall(group, now):
            return dataclasses.replace(status, failed=True)
        return status

    def _drop_gone(self, group: WorkerGroup) -> None:
        """A rank that has exited cannot answer: stop waiting for it."""
        if not any(g.asked for g in self.gatherings.values()):
            return
        gone = {(w.attempt, w.local_rank) for w in group.workers if not w.alive()}
        for gathering in self.gatherings.values():
            for key in gone & gathering.asked.keys():
                rank = gathering.asked.pop(key)
                gathering.stacks[rank] = RankStacks(rank, note=EXITED)

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
            self.check = self._start(group, None)
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
            self.check = self._start(group, None)
        if not self.check.done:
            return False
        views = self._views(group, now, self.check)
        verdict = judge_stall(views, self.stall_timeout, self.all_waiting_after)
        if verdict.kind is Kind.NONE:  # someone still works: look again a little later
            self.check = None
            self.next_check = now + max(1.0, self.stall_timeout / 2)
            return False
        self._decide(verdict, views, group, self.check, now)
        self.stalled = True
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

    def _decide(self, verdict: Verdict, views: list[RankView], group: WorkerGroup,
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
            left = verdict.kind is Kind.LEFT_EARLY
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
    still alive (stuck, or returned early), whose stacks tell."""
    failed = [w for w in group.workers if w.error is not None or (
        w.exited_at is not None and w.proc is not None and w.proc.returncode not in (0, None))]
    return bool(failed) and all(w.error is not None and is_consequence(w.failure())
                                for w in failed)
