"""A one-shot job's loop, modelled on torch's ``SimpleElasticAgent._invoke_run`` but ours: it
runs on a kernel thread (no signal handlers), emits the events renderers need, and gives
every attempt a fresh store namespace so restarts always work.

next round, start, monitor, decide: restart on a failure (counts against --max-restarts),
a new round on a membership change (does not), or leave a failing slot out. The loop decides
(with ``policy``); the engine, its worker group and the role carry it out and report back.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ...result import JobResult, JobState, RankFailure, is_consequence, root_cause_order
from ...wire.events import Restarting, WorkerFailed
from ...wire.messages import Action
from ..policy import FollowUp, GroupOutcome, RegroupClock, during_group, final_state, what_ended
from ..round_info import RoundInfo
from .engine import Engine


class JobLoop:
    """Runs one job on this machine until it ends; its result."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.regroup_clock = RegroupClock()  # machines waiting to join: torch's mechanism

    def run(self) -> JobResult:
        engine, inbox = self.engine, self.engine.switchboard
        final = JobState.FAILED
        try:
            engine.set_state(JobState.RENDEZVOUS)
            engine.open()
            while True:
                if inbox.drain() is Action.STOP:
                    final = JobState.STOPPED
                    break
                engine.apply_resize()
                info = engine.next_round()
                if info is None:
                    failed = inbox.heard is Action.NODE_FAILED
                    final = JobState.FAILED if failed else JobState.STOPPED
                    engine.failures = list(engine.role.node_failures) if failed else []
                    break
                engine.start_group(info)
                self.regroup_clock.reset()
                step = what_ended(self._end_group(self._monitor(), info), inbox.heard)
                if step is GroupOutcome.NODE_FAILED:  # what ended it here comes first
                    engine.failures = [*engine.role.node_failures,
                                       *root_cause_order(engine.failures)]
                final = final_state(step)
                next_ = engine.after_group(step)
                if next_ is FollowUp.END:
                    break
                if next_ in (FollowUp.RESTART, FollowUp.EXCLUDE):
                    engine.role.reforming(engine.round)
                if next_ is FollowUp.RESTART:
                    engine.recovery.count_restart()
                    engine.set_state(JobState.RESTARTING)
                    no_state = not engine.elastic_state.used and engine.restarts == 1
                    engine.emit(Restarting(engine.restarts, engine.spec.max_restarts,
                                           engine.failures[0], no_state=no_state))
                engine.set_state(JobState.RENDEZVOUS)
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            result = engine.finish(final)
        return result

    def _monitor(self) -> GroupOutcome:
        """Watch the group until something must be done; carry it out; say what it was."""
        engine, group = self.engine, self.engine.group
        assert group is not None
        while True:
            action = engine.switchboard.next_action(self._poll_interval())
            status = engine.hangs.watch(group.poll(), group)
            step = during_group(action, action is None and self._regroup_due(), status)
            if step is not GroupOutcome.WAIT:
                self._carry_out(step)
                engine.board.publish(**group.processes())
                return step

    def _poll_interval(self) -> float:
        """--monitor-interval; shorter while a rank's report pipe has closed and its exit
        is still to be seen (a killed rank: its exit code decides, moments later)."""
        group = self.engine.group
        closing = group is not None and any(
            w.channel_closed_at is not None and w.exited_at is None and w.result is None
            for w in group.workers)
        return min(self.engine.spec.monitor_interval, 0.005) if closing \
            else self.engine.spec.monitor_interval

    def _carry_out(self, step: GroupOutcome) -> None:
        engine, group = self.engine, self.engine.group
        assert group is not None
        if step is GroupOutcome.STOP:  # SIGINT first: the cell sees KeyboardInterrupt
            engine.set_state(JobState.STOPPING)
            engine.role.stopping_job(engine.stop_reason or "stopped")
            group.interrupt()
        elif step is GroupOutcome.REGROUP:  # a machine joins or is lost: the others regroup
            engine.role.regrouping(engine.round)
            engine.set_state(JobState.RESIZING)
            if self._stays():
                self._keep_survivors()
            else:
                group.stop_now()
        elif step is GroupOutcome.NODE_FAILED:
            engine.set_state(JobState.STOPPING)
            group.stop_now()
        elif step is GroupOutcome.FAILED:
            engine.set_state(JobState.STOPPING)
            failures = self._keep_survivors() if self._stays() else engine.tear_down()[1]
            engine.failures = engine.hangs.explain(failures)
            self._await_cause()
            if engine.switchboard.heard in (Action.REGROUP, Action.NODE_FAILED):  # a machine left
                engine.failures = [replace(f, consequence=True) for f in engine.failures]
            for failure in engine.failures:
                engine.emit(WorkerFailed(failure))
        elif step is GroupOutcome.RESIZED:
            engine.set_state(JobState.RESIZING)
            if self._stays():  # every rank left at the commit: all of them stay
                engine.survivors.keep(group, engine.switchboard.next_action,
                                      engine.spec.link_timeout)
            else:
                group.release()
        elif step is GroupOutcome.SUCCEEDED:
            group.release()

    def _stays(self) -> bool:
        """Survivors stay: asked for, and the cell uses State (it rolls back to a commit;
        a cell without one restarts as before)."""
        engine = self.engine
        return engine.survivors.on and engine.elastic_state.used

    def _keep_survivors(self) -> list[RankFailure]:
        """The healthy ranks park; the others are stopped (``node/survivors.py``). The
        ranks that failed on their own, root cause first, and those that could not leave.

        When only lost peers had failed as the ranks were asked to leave, the rank that
        died may not have been seen yet: a peer's error can reach the agent before the dead
        rank's report pipe closes and its shepherd exits. A rank whose process is gone is
        waited for first (``await_the_gone``); one still dying then is seen as the
        survivors leave: their leaving waits until every rank parked or ended (bounded:
        the link timeout, or a second without one leaving), so such a death is seen by its
        end: the failures are taken up to then, less the ranks stopped there for not
        leaving (their exit is the agent's doing)."""
        engine, group = self.engine, self.engine.group
        assert group is not None
        group.await_the_gone(engine.switchboard.next_action)  # a death is seen before it
        left_at = time.time()
        stuck = engine.survivors.keep(group, engine.switchboard.next_action,
                                      engine.spec.link_timeout)
        engine.switchboard.drain()
        failures = group.failures_before(left_at)
        if failures and all(is_consequence(f) for f in failures):
            stopped = {f.rank for f in stuck}
            failures = [f for f in group.failures_before(time.time())
                        if f.rank not in stopped or f.exc_type is not None]
        return [*failures, *stuck]

    def _regroup_due(self) -> bool:
        """Other machines wait for a round: leave the group (at its next commit, if State
        lets it)."""
        if not self.engine.spec.multi_node:
            return False
        now = time.monotonic()
        waiting = self.engine.nodes_waiting() if self.regroup_clock.check_now(now) else None
        return self.regroup_clock.due(now, waiting, self.engine.graceful)

    def _end_group(self, step: GroupOutcome, info: RoundInfo) -> GroupOutcome:
        """A group that succeeded here still needs the other machines' results."""
        group = self.engine.group
        if step is not GroupOutcome.SUCCEEDED or group is None:
            return step
        return self.engine.role.finish_round(info, group, self.engine.switchboard.next_action)

    def _await_cause(self) -> None:
        """Ranks that only lost their peers, in a job of several machines: the cause is on
        another machine, whose word (a regroup, its failure for good, its loss) comes
        within the link timeout; a restart here would be spent on someone else's fault."""
        engine = self.engine
        if not (engine.spec.multi_node and engine.failures
                and all(is_consequence(f) for f in engine.failures)):
            return
        deadline, inbox = time.monotonic() + engine.spec.link_timeout, engine.switchboard
        while inbox.heard is None and (left := deadline - time.monotonic()) > 0:
            inbox.next_action(left)
