"""A session's loop, on the kernel's machine: a group kept alive between
cells.

The group is formed as a job's is (the engine's round, workers from the warm pool,
torchrun's environment), then waits: each cell is one payload that every rank runs in its
persistent namespace (``cell_runner``). Between cells the loop blocks on its inbox (no
polling): a worker that dies while idle arrives there as its report pipe closing. A group
that broke (a rank died, stalled, or did not come back from an interrupt) fails the cell it
broke in, naming the rank (a cell the user interrupted comes back interrupted), and is
re-formed before the next cell: a new round, fresh workers, the setup cells replayed in
order (a ``State`` they make restores the last commit). Re-formations after a failure count
against ``--max-restarts``, as a job's restarts do, and a slot that fails again is left out
as a job's is; a resize does not count. What to do is decided in ``policy``.
With ``--survivors`` the healthy ranks stay, namespaces and all, and only the
new ranks start, replay the setup cells (on the new process group, collectives refused:
``worker/replay_alone.py``) and get what they still lack of a survivor's namespace
(``_form``, ``session_ship``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Collection

from ...result import JobResult, JobState, RankFailure
from ...wire.events import CellStarted, SessionBroken, SessionReformed
from ...wire.messages import Action, StopCommand
from ...wire.payload import Payload, step_payload
from ...worker import replay_alone
from ..inbox import CellRequest, InboxItem, InterruptCommand
from ..policy import CellStep, FollowUp, GroupOutcome, cell_state
from .cell_runner import CellOutcome, CellRunner, not_back
from .cells import CellEvents, SessionEndedError
from .engine import Engine
from .session_ship import NamespaceShipping

# Steps of _form: the process group made on every rank; the survivors' namespace sent.
GROUP = Payload(source="# the process group, made before the new ranks' setup replays")
SHIP = Payload(source="# the survivors' namespace, sent to the new ranks")


class SessionLoop:
    """Runs a session's cells on a group that outlives them; re-forms it when it breaks."""

    def __init__(self, engine: Engine, events: CellEvents) -> None:
        self.engine = engine
        self.events = events  # the engine's emit: to the running cell, or kept for the next
        self.runner = CellRunner(engine)
        # what the ranks that joined lack
        self.shipping = NamespaceShipping(engine, self.runner.others)
        self.setup: list[Payload] = []
        self.formed = False  # the group is up, whole, and has run its setup cells
        self.died_forming = False  # the last _form broke: a rank died in it
        self.unformed: set[int] = set()  # ranks new in the group forming: setup not replayed
        self.pending: deque[CellRequest] = deque()
        self.ended: JobState | None = None
        self.cell_started = time.time()
        engine.switchboard.loop_items = self._own

    def run(self) -> JobResult:
        engine = self.engine
        final = JobState.STOPPED
        try:
            engine.open()
            self._form()  # now: the first cell finds its workers ready
            while (request := self._next_cell()) is not None:
                self._serve_cell(request)
            final = self.ended or JobState.STOPPED
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            self.runner.dismiss()
            for request in self.pending:  # cells queued behind the end
                request.outcome.set_exception(SessionEndedError(
                    f"the session {engine.run_id} has ended; start a new one."))
            result = engine.finish(final)
        return result

    def _own(self, item: InboxItem) -> InboxItem | None:
        engine = self.engine
        match item:
            case CellRequest():
                self.pending.append(item)
                return None
            case InterruptCommand() if (self.events.cell is not None or self.pending) \
                    and engine.state is JobState.RENDEZVOUS:
                # A cell waits for a round (for machines): only a stop ends that wait.
                return StopCommand("interrupted while the session formed")
            case InterruptCommand():
                self.runner.interrupt = self.events.cell is not None
                return None
        return self.runner.own(item)

    def _whole(self) -> bool:
        """The group formed and did not break, and no machine has left (or failed for good)
        since; a resize is looked at separately."""
        regrouped = self.engine.switchboard.heard in (Action.REGROUP, Action.NODE_FAILED) \
            and not self.engine.membership.resize_pending
        return self.formed and not regrouped

    def _intact(self) -> bool:
        """The group can run the next cell."""
        return self.engine.group is not None and self._whole()

    def _next_cell(self) -> CellRequest | None:
        """Block until a cell comes (None: the session ends). A rank that dies meanwhile
        breaks the group at once, so that its peers do not wait for it."""
        engine = self.engine
        while self.ended is None:
            if engine.switchboard.latched() is Action.STOP:  # heard while a group broke
                self.ended = JobState.STOPPED
                break
            if self.pending:
                return self.pending.popleft()
            item = self.runner.wait_idle()
            if item is not None and engine.switchboard.handle(item) is Action.STOP:
                self.ended = JobState.STOPPED
            elif self._intact() and self.runner.died():
                self._break(self.runner.break_idle())
            elif self._whole() and self.runner.others.broken():
                engine.close_group()
                self._break(CellOutcome(
                    CellStep.BROKEN, self.runner.others.failures(),
                    "a rank on another machine died while the session was idle"))
        return None

    def _serve_cell(self, request: CellRequest) -> None:
        self.cell_started = time.time()
        self.events.begin(request)
        try:
            result = self._run_cell(request)
        except BaseException as exc:
            request.outcome.set_exception(exc)
            raise
        finally:
            self.events.end()
        request.outcome.set_result(result)

    def _run_cell(self, request: CellRequest) -> JobResult:
        engine = self.engine
        engine.switchboard.drain()  # a rank's death already known breaks the group first
        if self._intact() and self.runner.died_before_the_cell():
            self._break(self.runner.break_idle())
        if self.ended is not None:
            return self._result(self.ended, engine.failures)
        if not self._intact() or engine.membership.resize_pending or engine.nodes_waiting():
            failures = self._form_for_a_cell()
            if failures is not None:
                return self._result(self.ended or JobState.FAILED, failures)
        self._cell_started()
        outcome = self.shipping.check(self._run, request.payload) or self._run(request.payload)
        while outcome.step is CellStep.RESIZED:  # every rank left at a commit: go on resized
            self.formed = False
            failures = self._form_for_a_cell()
            if failures is not None:
                return self._result(self.ended or JobState.FAILED, failures)
            outcome = self._run(request.payload)
        if outcome.step is CellStep.STOP:
            self.ended = JobState.STOPPED
            return self._result(JobState.STOPPED, [], engine.stop_reason)
        stuck = self.runner.stuck
        state = cell_state(outcome.step, outcome.failures, interrupted=self.runner.interrupt,
                           stuck=stuck)
        if state is JobState.SUCCEEDED and request.setup:
            self.setup.append(request.payload)
        why = f"interrupted: {not_back(stuck)}" if stuck else "interrupted"
        return self._result(state, outcome.failures, why)

    def _cell_started(self) -> None:
        engine = self.engine
        group, info = engine.group, engine.round
        assert group is not None and info is not None
        engine.metrics.take()  # what setup replays logged is not this cell's
        engine.emit(CellStarted(group.attempt, group.ranks, info.world_size, info.nnodes,
                                info.round, engine.restarts, began=self.cell_started))

    def _run(self, payload: Payload | None, ranks: Collection[int] | None = None
             ) -> CellOutcome:
        outcome = self.runner.run(payload, ranks)
        if outcome.step is CellStep.BROKEN:
            self._break(outcome)
        return outcome

    def _break(self, outcome: CellOutcome) -> None:
        """The group is gone: re-form before the next cell, if a restart is left (or without
        a slot that failed again, which is no restart)."""
        engine = self.engine
        engine.failures = outcome.failures
        next_ = engine.after_group(GroupOutcome.FAILED)
        reforms = next_ is not FollowUp.END
        if next_ is FollowUp.RESTART:
            engine.recovery.count_restart()
        elif not reforms:
            self.ended = JobState.FAILED
        self.formed = False
        engine.emit(SessionBroken(outcome.broke_because, engine.restarts,
                                  engine.spec.max_restarts, reforms))
        engine.set_state(JobState.RESTARTING if reforms else JobState.FAILED)

    def _form_for_a_cell(self) -> list[RankFailure] | None:
        """``_form``, again while a rank dies as the group forms (a new rank in its setup
        replay, say): each is a restart, as a death between cells is, and the cell waits
        for the group rather than failing for a death that was not its own. A setup cell
        that raises is not tried again."""
        while True:
            self.died_forming = False
            failures = self._form()
            if failures is None or self.ended is not None or not self.died_forming:
                return failures

    def _form(self, keep: bool = True) -> list[RankFailure] | None:
        """New round, fresh workers, setup cells replayed (a State restores the last
        commit). None once the group is up; else why not (failures, or none: stopped).
        Survivors stay (``keep``, if asked for): the healthy ranks keep their processes
        and namespaces; the process group is made on every rank, and the new ranks replay
        the setup cells alone on it (collectives refused); should one fail there, every
        rank starts again and replays them."""
        engine = self.engine
        if self.ended is not None:
            return engine.failures
        first = engine.attempt < 0
        if keep and engine.survivors.on and engine.group is not None:  # the idle ranks stay
            engine.survivors.keep(engine.group, engine.switchboard.next_action,
                                  engine.spec.link_timeout, session=True)
            # but not one that a death cut off in its setup replay: it lacks what they make
            engine.survivors.drop(self.unformed)
        engine.close_group(keep=keep)
        if not first:  # the other machines leave their groups for the new round too
            engine.role.regrouping(engine.round)
        engine.apply_resize()
        engine.set_state(JobState.RENDEZVOUS)
        info = engine.next_round()
        if info is None:
            self.ended = JobState.STOPPED
            return []
        engine.start_group(info)
        stayed = engine.survivors.stayed
        self.runner.others.new_round(info)
        assert engine.group is not None
        new = set(range(info.world_size)) - set(stayed)  # other machines' ranks all new
        self.unformed = new
        alone = bool(stayed)  # survivors keep what the setup cells made
        if not alone:
            self.shipping.forget()
        replays = self.setup if new else []
        grouped = replays and alone and engine.payload.init_process_group  # not --no-init
        steps: list[Payload | None] = [None, *([GROUP] if grouped else []),
                                       *replays, *([SHIP] if new and alone else [])]
        for payload in steps:  # None: sent at start
            if payload is SHIP:  # then the survivors' namespace, for what the ranks lack
                outcome = self.shipping.ship(self._run, stayed, new)
            elif payload is GROUP:
                # every rank makes the group the setup cells replayed alone find
                outcome = self._run(step_payload(engine.payload, replay_alone.make_group,
                                                 make_group=True))
            else:
                if payload is not None and alone:
                    payload = dataclasses.replace(payload, replayed_alone=True)
                outcome = self._run(payload, new if payload is not None and alone else None)
            if outcome.step is CellStep.STOP:
                self.ended = JobState.STOPPED
                return []
            if outcome.step is CellStep.DONE and outcome.failures and alone:
                engine.close_group()  # it needs the group: as without survivors
                return self._form(keep=False)
            if outcome.step is not CellStep.DONE or outcome.failures:
                self.died_forming = outcome.step is CellStep.BROKEN
                if outcome.step is CellStep.DONE:  # a setup cell failed: no group for cells
                    engine.close_group()
                    self._break(CellOutcome(CellStep.BROKEN, outcome.failures,
                                            "a setup cell failed when it was replayed"))
                return outcome.failures
        self.formed, self.unformed = True, set()
        if not first:
            step = (engine.elastic_state.snapshots.meta or {}).get("step")
            engine.emit(SessionReformed(len(self.setup), step, engine.world_size))
        return None

    def _result(self, state: JobState, failures: list[RankFailure],
                reason: str | None = None) -> JobResult:
        """A cell's result (the engine's, as a job's): its ranks' values on success."""
        return self.engine.result(state, failures, started=self.cell_started,
                                  stop_reason=reason or "the session ended",
                                  others=(self.runner.others.results(), {}))
