"""One payload on a session's group: a cell, a setup cell replayed, or the payload a group
starts with. Every rank runs it in its persistent namespace (``worker/session_cells.py``) and
answers; the head's runner waits for the other machines' reports too. Used by both session
loops (the head's or one machine's, ``session_loop``; a joined machine's,
``session_joined``), each with its engine.

A rank that raised, or a Ctrl-C, interrupts the others (they may wait for it in a
collective); a rank that dies, that does not come back from the interrupt, or that the
stall watchdog names (``--stall-timeout``) breaks the group: it is torn down, and the cell
fails naming that rank. What to do is decided in ``policy.during_cell``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from collections.abc import Collection
from dataclasses import dataclass

from ...result import JobState, RankFailure, root_cause_order, what_happened
from ...wire.events import WorkerFailed
from ...wire.link_messages import CellReport, Leaving
from ...wire.messages import Exit, Interrupt, Run
from ...wire.payload import Payload
from ..inbox import FromLink, InboxItem, OutputEnded
from ..node.workers import CHANNEL_CLOSE_GRACE, NOTICE_GRACE, WorkerState, wait_for_exit
from ..policy import CellStatus, CellStep, during_cell
from .cells import OtherMachines
from .engine import Engine

# Ranks still in the cell this long after an interrupt are stuck (a collective, C code).
INTERRUPT_GRACE = 5.0
NOT_BACK = f"did not come back within {INTERRUPT_GRACE:g}s of the interrupt"
# A rank that answered but whose output has not reached its end mark by then (it closed its
# stdout, say) is not waited for any longer.
OUTPUT_GRACE = 2.0
# Idle workers told to leave when the session ends exit within this, or are stopped.
EXIT_GRACE = 2.0


@dataclass(frozen=True)
class CellOutcome:
    """What ended a payload on the group, the ranks that failed (root cause first) and,
    when the group broke, why."""

    step: CellStep
    failures: list[RankFailure]
    broke_because: str = ""


class CellRunner:
    """Runs payloads on the engine's current group, one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.others = OtherMachines(engine.role)  # a multi-node session's other machines
        self.interrupt = False  # the user interrupted the running cell
        self.stuck: tuple[int, ...] = ()  # ranks that did not come back from an interrupt
        self.marks: set[tuple[int, str]] = set()  # (rank, stream) whose cell output ended

    def own(self, item: InboxItem) -> InboxItem | None:
        """Take the inbox items that are the runner's (None); pass on the rest."""
        engine = self.engine
        match item:
            case OutputEnded(attempt, rank, stream):
                if engine.group is not None and attempt == engine.group.attempt:
                    self.marks.add((rank, stream))
                return None
            case FromLink(message=CellReport() as report):
                self.others.note(report)
                return None
            case FromLink(message=None | Leaving()) if self.others.expected:
                self.others.lost = True  # then what the role makes of it
        return item

    def run(self, payload: Payload | None, ranks: Collection[int] | None = None
            ) -> CellOutcome:
        """Send ``payload`` to every rank, or to ``ranks`` alone (None: it was sent when the
        group started) and wait for their answers."""
        engine, group = self.engine, self.engine.group
        assert group is not None
        targets = [w for w in group.workers if ranks is None or w.global_rank in ranks]
        # the others are not in this payload: as if they had answered and ended their output
        self.marks = {(w.global_rank, s) for w in group.workers if w not in targets
                      for s in ("stdout", "stderr")}
        self.interrupt = False
        self.stuck = ()
        engine.hangs.reset(group.attempt)  # the stall watchdog watches this cell alone
        engine.elastic_state.landing = None  # a cell ends with its commits in (or dropped)
        for worker in targets:
            worker.result = worker.error = None
            worker.state = WorkerState.HEALTHY
            worker.parked = worker.idle = False
            if payload is not None:
                worker.send(Run(payload))
        if payload is not None:
            self.others.send_cell(payload, None if ranks is None else tuple(sorted(ranks)))
        engine.set_state(JobState.RUNNING)
        interrupted_at: float | None = None
        answered_at: float | None = None
        while True:
            action = engine.switchboard.next_action(engine.spec.monitor_interval)
            group.poll()  # notes exits
            answered = all(w.result is not None or w.error is not None
                           for w in targets) and self.others.answered()
            if answered and answered_at is None:
                answered_at = time.monotonic()
            ended = {(w.global_rank, s) for w in group.workers for s in ("stdout", "stderr")}
            status = CellStatus(
                died=self.died() or self.others.broken(),
                errors=any(w.error is not None for w in group.workers)
                or bool(self.others.failures()),
                resized=all(w.resized for w in group.workers),
                reported=answered and (ended <= self.marks or time.monotonic()
                                       - (answered_at or 0.0) > OUTPUT_GRACE),
                stalled=engine.hangs.stalled(group))
            step = during_cell(
                action, status, interrupt=self.interrupt, grace=INTERRUPT_GRACE,
                interrupted_for=None if interrupted_at is None
                else time.monotonic() - interrupted_at)
            if step is CellStep.INTERRUPT:
                interrupted_at = time.monotonic()
                self.interrupt_running()
                self.others.interrupt()
            elif step is not CellStep.WAIT:
                break
        own = root_cause_order([w.failure() for w in targets if w.error is not None])
        if step is CellStep.DONE:
            for worker in targets:  # what they reported is this cell's, told now
                worker.idle = True
            engine.set_state(JobState.IDLE)
            self._emit_failures(own)  # other machines send their own
            return CellOutcome(step, root_cause_order([*own, *self.others.failures()]))
        if step is CellStep.BROKEN:
            return self._broken(status)
        if step is CellStep.RESIZED:
            engine.close_group()
        return CellOutcome(step, own)

    def _broken(self, status: CellStatus) -> CellOutcome:
        group = self.engine.group
        assert group is not None
        dead = self.dead_ranks()
        if not (status.died or status.stalled):  # the interrupt's grace ran out
            self.stuck = tuple(w.global_rank for w in group.workers
                               if w.result is None and w.error is None)
        # Survivors stay when a rank died (one that stalled or did not come back from an
        # interrupt takes the group down as before).
        keep = bool(dead) and not (self.stuck or status.stalled)
        failures = root_cause_order([*self.tear_down(self.stuck, keep=keep),
                                     *self.others.failures()])
        if self.others.broken():
            reason = "a rank on another machine died in the cell"
        elif self.stuck:
            reason = not_back(self.stuck)
        elif status.stalled and not dead and failures:  # the watchdog's cause comes first
            reason = f"{what_happened(failures[0])} in the cell"
        else:
            reason = death(failures, dead, "in the cell")
        return CellOutcome(CellStep.BROKEN, failures, reason)

    def interrupt_running(self) -> None:
        for worker in self.engine.group.workers if self.engine.group else []:
            if worker.result is None and worker.error is None and worker.control is not None:
                with contextlib.suppress(OSError):  # gone: its pipe closing says so
                    worker.control.send(Interrupt())

    def died(self) -> bool:
        return bool(self.dead_ranks())

    def died_before_the_cell(self) -> bool:
        """Before a cell is sent: a rank whose process was killed a moment ago (its report
        pipe's end still on its way) is waited for, so that the group re-forms first and
        the cell runs on it, rather than being sent to a dead rank and failing."""
        group = self.engine.group
        assert group is not None
        group.await_the_gone(self.engine.switchboard.next_action)
        return self.died()

    def wait_idle(self) -> InboxItem | None:
        """The next inbox item while no cell runs (blocks). None once a grace has passed
        while a rank's shepherd had exited without its report pipe closing: its death
        counts now, and no item may come to say so."""
        group = self.engine.group
        ending = False
        if group is not None:
            group.poll()  # notes exits
            ending = any(w.exited_at is not None and not w.has_ended()
                         for w in group.workers)
        try:
            return self.engine.inbox.get(timeout=CHANNEL_CLOSE_GRACE if ending else None)
        except queue.Empty:
            return None

    def dead_ranks(self) -> set[int]:
        """This machine's ranks whose process has ended (but at a resize)."""
        group = self.engine.group
        return {w.global_rank for w in group.workers if w.has_ended()
                and not w.resized} if group is not None else set()

    def _emit_failures(self, failures: list[RankFailure]) -> None:
        for failure in failures:
            self.engine.emit(WorkerFailed(failure))

    def tear_down(self, stuck: tuple[int, ...] = (), keep: bool = False) -> list[RankFailure]:
        """Stop the group at once; its failures, root cause first. ``stuck``: ranks that
        did not come back from an interrupt: consequences when a rank raised first (the
        interrupt was for it), else what broke the group. ``keep``: survivors stay, if the
        session asked for them: the healthy ranks are kept for the next group with their
        namespaces, the others stopped."""
        engine, group = self.engine, self.engine.group
        assert group is not None
        keep = keep and engine.survivors.on
        if keep:
            group.await_the_gone(engine.switchboard.next_action)  # a death is seen before it
            teardown_at = time.time()
            left = engine.survivors.keep(group, engine.switchboard.next_action,
                                         engine.spec.link_timeout, session=True)
            engine.switchboard.drain()
            failures = [*group.failures_before(teardown_at), *left]
        else:
            teardown_at, failures = engine.tear_down()
        raised = any(f.exc_type not in (None, "KeyboardInterrupt") for f in failures)
        failures += [dataclasses.replace(w.failure(), time=teardown_at, reason=NOT_BACK,
                                         consequence=raised)
                     for w in group.workers if w.global_rank in stuck]
        failures = engine.hangs.explain(root_cause_order(failures))
        self._emit_failures(failures)
        engine.close_group(keep=keep)
        return failures

    def break_idle(self) -> CellOutcome:
        """A rank died while no cell ran: the group is gone (but its survivors, if kept)."""
        dead = self.dead_ranks()
        self._hear_how_they_ended(dead)
        failures = self.tear_down(keep=True)
        return CellOutcome(CellStep.BROKEN, failures,
                           death(failures, dead, "while the session was idle"))

    def _hear_how_they_ended(self, ranks: set[int]) -> None:
        """A dead rank's shepherd tells how its worker ended just after the report pipe
        closed: serve the inbox until it has (a moment), so that the failure names the
        signal or code, not the teardown that stops the shepherd."""
        group = self.engine.group
        assert group is not None
        deadline = time.monotonic() + NOTICE_GRACE
        while any(w.ended_status is None and not w.exited() for w in group.workers
                  if w.global_rank in ranks) and time.monotonic() < deadline:
            self.engine.switchboard.next_action(0.02)

    def dismiss(self) -> None:
        """The session ends: idle workers leave on their own (their process group closes
        cleanly); the engine's ``finish`` stops any still there."""
        group = self.engine.group
        if group is None:
            return
        self.interrupt_running()
        for worker in group.workers:
            worker.send(Exit())
        wait_for_exit(group.workers, EXIT_GRACE)


def not_back(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} {NOT_BACK}"


def death(failures: list[RankFailure], dead: set[int], when: str) -> str:
    """Why the group broke: the first rank that died, and what it did."""
    root = next((f for f in failures if f.rank in dead), None)
    if root is None:
        return f"a rank died {when}"
    return what_happened(root) + ("" if root.reason else f" {when}")
