"""The agent's loop, modelled on torch's ``SimpleElasticAgent._invoke_run`` but ours: it runs
on a kernel thread (no signal handlers), emits the events renderers need, and gives every
attempt a fresh store namespace so restarts always work.

The loop decides (with ``policy``); the worker group, the role (one machine, head, joined
machine) and the State server carry it out and report back."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ..events import (
    Committed,
    EventSink,
    JobFinished,
    MembershipChanged,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    StateChanged,
    WorkerFailed,
    WorkersStarted,
)
from ..logs import is_default, open_run, prune, rank_dir
from ..messages import (
    Action,
    NodeRequest,
    ScaleCommand,
    StateRequest,
    StopCommand,
)
from ..payload import Payload
from ..protocol import new_secret
from ..result import JobResult, JobState, assemble_result, root_cause_order
from ..spec import JobSpec
from .group import WorkerGroup
from .hangs import HangWatch
from .hub import FromLink
from .policy import (
    Membership,
    Next,
    RegroupClock,
    Resize,
    Step,
    after_group,
    final_state,
    most_urgent,
    settle,
)
from .policy import while_running as decide
from .rendezvous import Rendezvous, RoundInfo
from .roles import JoinedJob, role_for
from .snapshots import SnapshotStore, StateServer
from .status import StatusBoard
from .workers import Worker, WorkerReport, torchrun_env


class Agent:
    """Supervises one job on this machine: rendezvous, start, monitor, decide, finish."""

    def __init__(
        self, spec: JobSpec, payload: Payload, run_id: str, emit: EventSink,
        inbox: queue.Queue[Any], board: StatusBoard, *, token: str | None = None,
        joined: JoinedJob | None = None,
    ) -> None:
        self.spec = spec
        self.payload = payload
        self.run_id = run_id
        self.emit = emit
        self.inbox = inbox
        self.board = board
        self.key = new_secret()
        self.log_root = spec.log_dir / run_id
        self.run_lock: int | None = None  # held while the job runs: see logs.open_run
        self.role = role_for(spec, run_id, emit, inbox, payload, token=token, joined=joined)
        self.hangs = HangWatch(spec, emit, self.role)  # stalls, stacks, early exits
        self.snapshots = SnapshotStore(spec.checkpoint_dir)
        # The head holds the snapshots; a joined machine asks it.
        self.server = None if joined else StateServer(self.snapshots, self._committed,
                                                      self._leave_at_commit)
        self.membership = Membership(spec.nproc)
        self.regroup_clock = RegroupClock()
        self.rendezvous: Rendezvous | None = None
        self.round: RoundInfo | None = None
        self.group: WorkerGroup | None = None
        self.state = JobState.RENDEZVOUS
        self.restarts = 0
        self.attempt = -1
        self.world_size = 0
        self.failures: list[Any] = []
        self.stop_reason: str | None = None
        self.stop_requested = False
        self.node_failed = False  # another machine failed for good: latched, as a stop
        self.uses_state = False  # a worker asked for the elastic State

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> JobResult:
        final = JobState.FAILED
        try:
            self._set_state(JobState.RENDEZVOUS)
            self.run_lock = open_run(self.log_root)  # first, so no prune takes this run
            if is_default(self.spec.log_dir):
                prune(self.spec.log_dir)
            if self.server is not None:
                self.server.resume_from_checkpoint()
            self.rendezvous = self.role.open()
            self.board.publish(join_command=self.role.join_command)
            while True:
                if self._drain() is Action.STOP:
                    final = JobState.STOPPED
                    break
                if change := self.membership.apply():
                    self.emit(MembershipChanged(*change))
                info = self._next_round()
                if info is None:
                    final = JobState.STOPPED
                    break
                self._start_group(info)
                step = settle(self._end_group(self._monitor(), info),
                              stop_requested=self.stop_requested, node_failed=self.node_failed)
                final = final_state(step)
                next_ = after_group(step, self.restarts, self.spec.max_restarts)
                if next_ is Next.END:
                    break
                if next_ is Next.RESTART:
                    self.restarts += 1
                    self.board.publish(restarts=self.restarts)
                    self._set_state(JobState.RESTARTING)
                    self.emit(Restarting(self.restarts, self.spec.max_restarts,
                                         self.failures[0]))
                self._set_state(JobState.RENDEZVOUS)
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            result = self._finish(final)
        return result

    def _monitor(self) -> Step:
        """Watch the group until something must be done; carry it out; say what it was."""
        assert self.group is not None
        while True:
            action = self._next_action(self.spec.monitor_interval)
            status = self.hangs.watch(self.group.poll(), self.group)
            step = decide(action, self._regroup_due(), status)
            if step is not Step.WAIT:
                self._carry_out(step)
                self.board.publish(pids=self.group.live_pids())
                return step

    def _carry_out(self, step: Step) -> None:
        group = self.group
        assert group is not None
        if step is Step.STOP:  # SIGINT first: the cell sees KeyboardInterrupt
            self._set_state(JobState.STOPPING)
            self.role.stopping_job(self.stop_reason or "stopped")
            group.interrupt()
        elif step is Step.REGROUP:
            self.role.regrouping()
            self._set_state(JobState.RESIZING)
            group.stop_now()
        elif step is Step.NODE_FAILED:
            self._set_state(JobState.STOPPING)
            group.stop_now()
            self.failures = root_cause_order([*self.failures, *self.role.node_failures])
        elif step is Step.FAILED:
            self._set_state(JobState.STOPPING)
            teardown_at = group.tear_down()
            self._drain()  # error reports still in flight
            self.failures = self.hangs.explain(group.failures_before(teardown_at))
            for failure in self.failures:
                self.emit(WorkerFailed(failure))
        elif step is Step.RESIZED:
            self._set_state(JobState.RESIZING)
            group.release()
        elif step is Step.SUCCEEDED:
            group.release()

    def _end_group(self, step: Step, info: RoundInfo) -> Step:
        """A group that succeeded here still needs the other machines' results."""
        if step is not Step.SUCCEEDED:
            return step
        assert self.group is not None
        outcome = self.role.finish_round(info, self.group, self._next_action)
        if outcome is JobState.STOPPED:
            return Step.STOP
        if outcome is JobState.FAILED:
            self.failures = root_cause_order([*self.failures, *self.role.node_failures])
            return Step.NODE_FAILED
        return Step.SUCCEEDED

    def _finish(self, final: JobState) -> JobResult:
        """Release everything the job held and tell the other machines, each step even
        when an earlier one raised; then report the result."""
        errors: list[BaseException] = []

        def attempt(release: Callable[[], object]) -> None:
            try:
                release()
            except Exception as exc:
                errors.append(exc)

        attempt(self._close_group)
        attempt(self._release_run_lock)
        attempt(lambda: self.role.close_rendezvous(self.rendezvous))
        result: JobResult | None = None
        try:
            result = self._result(final)
        finally:
            attempt(self.hangs.close)
            attempt(self.snapshots.close)
            attempt(lambda: self._set_state(final))
            attempt(lambda: self.role.finished(final, self.failures))
            if result is not None:
                attempt(lambda: self.emit(JobFinished(result)))
            # The State server calls back into this agent: without this, the stores and
            # pipes would wait for the garbage collector (a notebook ran out of files).
            self.server = self.rendezvous = self.group = None
        if errors:
            raise errors[0]
        return result

    def _result(self, final: JobState) -> JobResult:
        others, other_tails = self.role.other_ranks(self.round) \
            if final is JobState.SUCCEEDED else ({}, {})
        # The result is plain data: assembling it cannot fail on a released resource.
        group = self.group
        return assemble_result(
            run_id=self.run_id, state=final, world_size=self.world_size,
            restarts=self.restarts, max_restarts=self.spec.max_restarts,
            started=self.board.current.started, log_dir=self.log_root,
            failures=self.failures, stop_reason=self.stop_reason,
            resizes=self.membership.resizes, commit=self.snapshots.meta,
            snapshot=self.snapshots.blob,
            ranks={**(group.results() if group else {}), **others},
            tails={**(group.tails() if group else {}), **other_tails},
            stacks=self.hangs.kept,
        )

    def _release_run_lock(self) -> None:
        if self.run_lock is not None:
            os.close(self.run_lock)
            self.run_lock = None

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.board.publish(pids={})

    # -- rounds and groups ---------------------------------------------------------------

    def _next_round(self) -> RoundInfo | None:
        """Join the next round, serving stop requests meanwhile. None when a stop came
        first, or when a joined machine finds that the job has ended."""
        assert self.rendezvous is not None
        try:
            info = self.rendezvous.next_round_unless(
                self.membership.nproc, lambda: self._drain() is Action.STOP,
                self.spec.monitor_interval, cancel=self.role.hosts_rendezvous)
        except RendezvousClosedError:
            if self.role.hosts_rendezvous:
                raise
            self.stop_reason = "the job ended before this machine joined a round"
            return None
        if info is not None:
            self.round = info
            self.emit(RendezvousCompleted(info.round, info.node_rank, info.nnodes,
                                          info.world_size, info.master_addr,
                                          info.master_port))
        return info

    def _start_group(self, info: RoundInfo) -> None:
        self.attempt += 1
        self.world_size = info.world_size
        self.regroup_clock.reset()
        self.failures = []
        self._set_state(JobState.STARTING)
        group = self.group = WorkerGroup(self.attempt, info.base_rank, self.membership.nproc)

        def env_for(worker: Worker) -> dict[str, str]:
            error_file = rank_dir(self.log_root, self.attempt, worker.global_rank) / "error.json"
            return torchrun_env(worker, info, self.spec, nproc=self.membership.nproc,
                                run_id=self.run_id, restart_count=self.restarts,
                                error_file=error_file, network=self.role.network)

        group.start(self.payload, env_for, cwd=self.payload.cwd, key=self.key,
                    log_root=self.log_root, inbox=self.inbox,
                    emit=self.hangs.noting_output(self.emit), pool=self.spec.pool)
        self.emit(WorkersStarted(self.attempt, self.restarts, group.ranks, group.pids))
        self.board.publish(world_size=info.world_size, nnodes=info.nnodes,
                           restarts=self.restarts, pids=group.live_pids())

    # -- what arrives on the inbox -------------------------------------------------------

    def _next_action(self, timeout: float) -> Action | None:
        """Handle what arrives within ``timeout`` (then whatever else is queued); the most
        urgent action asked for. Raises when the rendezvous store held something this job
        did not write (torch's heartbeat thread may have been the one to read it)."""
        if self.rendezvous is not None:
            self.rendezvous.check()
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return self._latched()
        return most_urgent(self._handle(item), self._drain())

    def _drain(self) -> Action | None:
        """Handle queued items without waiting. A stop, or another machine's failure for
        good, once heard, stays in force."""
        action = None
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            action = most_urgent(action, self._handle(item))
        return most_urgent(action, self._latched())

    def _latched(self) -> Action | None:
        if self.stop_requested:
            return Action.STOP
        return Action.NODE_FAILED if self.node_failed else None

    def _handle(self, item: Any) -> Action | None:
        if self.hangs.handle(item, self.group):  # stacks and progress
            return None
        match item:
            case StopCommand(reason):
                self.stop_reason = reason
                self.stop_requested = True
                self.role.stop_requested(reason)
                return Action.STOP
            case ScaleCommand(nproc, immediate):
                graceful = self.uses_state and not immediate and self.state is JobState.RUNNING
                verdict = self.membership.request(nproc, graceful=graceful)
                if verdict is not Resize.NONE:
                    self.emit(ResizeRequested(nproc, verdict is Resize.AT_COMMIT))
                return Action.REGROUP if verdict is Resize.NOW else None
            case WorkerReport() if self.group is not None:
                request = self.group.record(item)
                if request is not None:
                    self._serve(self.group.workers[item.local_rank], request)
                elif self.state is JobState.STARTING and self.group.running:
                    self._set_state(JobState.RUNNING)
            case FromLink():
                if isinstance(item.message, NodeRequest):
                    self.uses_state = True  # another machine's ranks use State
                action = self.role.handle(item, self.group, self.server, self.world_size)
                if action is Action.STOP:
                    self.stop_reason = self.role.stop_reason
                    self.stop_requested = True
                elif action is Action.NODE_FAILED:
                    self.node_failed = True
                return action
        return None

    # -- State ---------------------------------------------------------------------------

    def _serve(self, worker: Worker, request: StateRequest) -> None:
        self.uses_state = True
        self.role.serve(worker, request, self.server, self.world_size)

    def _leave_at_commit(self) -> bool:
        """Every rank leaves at this commit when this machine resizes or others wait."""
        leave = self.membership.resize_pending or self._nodes_waiting()
        if leave:
            self._set_state(JobState.RESIZING)
        return leave

    def _committed(self, event: Committed) -> None:
        self.board.publish(last_commit=self.snapshots.meta)
        self.emit(event)

    # -- membership across machines ------------------------------------------------------

    def _nodes_waiting(self) -> bool:
        return self.spec.multi_node and self.rendezvous is not None \
            and self.role.nodes_waiting(self.rendezvous)

    def _regroup_due(self) -> bool:
        now = time.monotonic()
        if not self.spec.multi_node:
            return False
        waiting = self._nodes_waiting() if self.regroup_clock.check_now(now) else None
        graceful = self.uses_state and self.state is JobState.RUNNING
        return self.regroup_clock.due(now, waiting, graceful)

    def _set_state(self, state: JobState) -> None:
        if state is not self.state or state is JobState.RENDEZVOUS:
            self.state = state
            self.board.publish(state=state, finished=time.time() if state.is_final else None)
            self.emit(StateChanged(state))

