"""The agent's loop, modelled on torch's ``SimpleElasticAgent._invoke_run`` but ours: it runs
on a kernel thread (no signal handlers), emits the events renderers need, and gives every
attempt a fresh store namespace so restarts always work.

The loop decides (with ``policy``); the worker group, the role (one machine, head, joined
machine) and the State server carry it out and report back."""

from __future__ import annotations

import queue
import time
from dataclasses import replace
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ..events import (
    Committed,
    EventSink,
    Excluded,
    MembershipChanged,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    StateChanged,
    WorkerFailed,
    WorkersStarted,
)
from ..logs import RunFolder, is_default, prune
from ..messages import (
    Action,
    NodeRequest,
    ScaleCommand,
    StateRequest,
    StopCommand,
)
from ..payload import Payload
from ..protocol import new_secret
from ..result import JobResult, JobState, is_consequence, root_cause_order
from ..spec import JobSpec
from .ending import finish
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
    own_failure,
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
        self.run_folder: RunFolder | None = None  # held while the job runs (logs.RunFolder)
        # The head makes its run's folder; another machine of the job on this host may
        # have made it before a joined one.
        self.fresh_run_folder = joined is None
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
        self.regroup_heard = False  # in this group: a failure then is a consequence of it
        self.excluded: list[str] = []  # this machine's slots left out, and why
        self.uses_state = False  # a worker asked for the elastic State

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> JobResult:
        final = JobState.FAILED
        try:
            self.set_state(JobState.RENDEZVOUS)
            self.open()
            while True:
                if self._drain() is Action.STOP:
                    final = JobState.STOPPED
                    break
                if change := self.membership.apply():
                    self.emit(MembershipChanged(*change))
                info = self._next_round()
                if info is None:
                    failed = self.node_failed and not self.stop_requested
                    final = JobState.FAILED if failed else JobState.STOPPED
                    self.failures = list(self.role.node_failures) if failed else []
                    break
                self._start_group(info)
                step = settle(self._end_group(self._monitor(), info),
                              stop_requested=self.stop_requested, node_failed=self.node_failed,
                              regroup=self.regroup_heard)
                if step is Step.NODE_FAILED:  # what ended it here comes first
                    self.failures = [*self.role.node_failures, *root_cause_order(self.failures)]
                final = final_state(step)
                next_ = self._after_group(step)
                if next_ is Next.END:
                    break
                if next_ in (Next.RESTART, Next.EXCLUDE):
                    self.role.reforming()
                if next_ is Next.RESTART:
                    self.restarts += 1
                    self.board.publish(restarts=self.restarts)
                    self.set_state(JobState.RESTARTING)
                    self.emit(Restarting(self.restarts, self.spec.max_restarts,
                                         self.failures[0]))
                self.set_state(JobState.RENDEZVOUS)
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            result = finish(self, final)
        return result

    def open(self) -> None:
        """What a job holds before its first round: its run's lock (first, so no prune
        takes this run), the checkpoint it resumes from, the rendezvous."""
        self.open_run_folder()
        if is_default(self.spec.log_dir):
            prune(self.spec.log_dir)
        if self.server is not None:
            self.server.resume_from_checkpoint()
        self.rendezvous = self.role.open()
        self.board.publish(join_command=self.role.join_command)

    def open_run_folder(self) -> RunFolder:
        """The run's log folder, held from the job's start (a joined session's agent opens
        it with its first group)."""
        if self.run_folder is None:
            self.run_folder = RunFolder.open(self.log_root, fresh=self.fresh_run_folder)
        return self.run_folder

    def _monitor(self) -> Step:
        """Watch the group until something must be done; carry it out; say what it was."""
        assert self.group is not None
        while True:
            action = self._next_action(self.spec.monitor_interval)
            status = self.hangs.watch(self.group.poll(), self.group)
            step = decide(action, action is None and self._regroup_due(), status)
            if step is not Step.WAIT:
                self._carry_out(step)
                self.board.publish(pids=self.group.live_pids())
                return step

    def _carry_out(self, step: Step) -> None:
        group = self.group
        assert group is not None
        if step is Step.STOP:  # SIGINT first: the cell sees KeyboardInterrupt
            self.set_state(JobState.STOPPING)
            self.role.stopping_job(self.stop_reason or "stopped")
            group.interrupt()
        elif step is Step.REGROUP:
            self.role.regrouping()
            self.set_state(JobState.RESIZING)
            group.stop_now()
        elif step is Step.NODE_FAILED:
            self.set_state(JobState.STOPPING)
            group.stop_now()
        elif step is Step.FAILED:
            self.set_state(JobState.STOPPING)
            teardown_at = group.tear_down()
            self._drain()  # error reports still in flight
            self.failures = self.hangs.explain(group.failures_before(teardown_at))
            self._await_cause()
            if self.regroup_heard or self.node_failed:  # a machine went: its consequences
                self.failures = [replace(f, consequence=True) for f in self.failures]
            for failure in self.failures:
                self.emit(WorkerFailed(failure))
        elif step is Step.RESIZED:
            self.set_state(JobState.RESIZING)
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
        if outcome is JobState.RESIZING:  # a machine was lost before its results came
            return Step.REGROUP
        if outcome is JobState.FAILED:
            return Step.NODE_FAILED
        return Step.SUCCEEDED

    # -- rounds and groups ---------------------------------------------------------------

    def _next_round(self) -> RoundInfo | None:
        """Join the next round, serving stop requests meanwhile. None when a stop came
        first, or when a joined machine finds that the job has ended."""
        assert self.rendezvous is not None
        try:
            info = self.rendezvous.next_round_unless(
                self.membership.nproc, lambda: self._drain() in (Action.STOP, Action.NODE_FAILED),
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
        self.regroup_heard = False
        self.failures = []
        self.set_state(JobState.STARTING)
        group = self.group = WorkerGroup(self.attempt, info.base_rank, self.membership.nproc)
        run_folder = self.open_run_folder()

        def env_for(worker: Worker) -> dict[str, str]:
            error_file = run_folder.error_file(self.attempt, worker.global_rank)
            return torchrun_env(worker, info, self.spec, nproc=self.membership.nproc,
                                run_id=self.run_id, restart_count=self.restarts,
                                error_file=error_file, network=self.role.network,
                                slots=self.membership.slots)

        group.start(self.payload, env_for, cwd=self.payload.cwd, key=self.key,
                    run_folder=run_folder, inbox=self.inbox,
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
        action = self._dispatch(item)
        if action is Action.REGROUP:
            self.regroup_heard = True
        return action

    def _dispatch(self, item: Any) -> Action | None:
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
                    self.set_state(JobState.RUNNING)
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

    # -- decisions after a group ---------------------------------------------------------

    def _after_group(self, step: Step) -> Next:
        """What follows; a slot excluded here is left out of the next round."""
        cause = own_failure(self.failures) if step is Step.FAILED else None
        slot = self.membership.slots[cause.local_rank] if cause else None
        next_ = after_group(
            step, self.restarts, self.spec.max_restarts,
            failed_before=slot is not None and self.membership.failed_before(slot),
            can_shrink=slot is not None and self.membership.nproc > self.spec.min_nproc)
        if next_ is Next.EXCLUDE and cause and slot is not None:
            self.emit(MembershipChanged(*self.membership.exclude(slot)))
            again = "failed again after a restart" if self.restarts \
                else "failed, no restart left"
            what, why = f"slot {slot} of this machine", f"{again} (rank {cause.rank}: " \
                f"{cause.headline})"
            self.excluded.append(f"{what}: {why}")
            self.emit(Excluded(what, why, goes_on=True))
        return next_

    def _await_cause(self) -> None:
        """Ranks that only lost their peers, in a job of several machines: the cause is on
        another machine, whose word (a regroup, its failure for good, its loss) comes
        within the link timeout; a restart here would be spent on someone else's fault."""
        if not (self.spec.multi_node and self.failures
                and all(is_consequence(f) for f in self.failures)):
            return
        deadline = time.monotonic() + self.spec.link_timeout
        while not (self.regroup_heard or self.node_failed or self.stop_requested) \
                and (left := deadline - time.monotonic()) > 0:
            self._next_action(left)

    # -- State ---------------------------------------------------------------------------

    def _serve(self, worker: Worker, request: StateRequest) -> None:
        self.uses_state = True
        self.role.serve(worker, request, self.server, self.world_size)

    def _leave_at_commit(self) -> bool:
        """Every rank leaves at this commit when this machine resizes or others wait."""
        leave = self.membership.resize_pending or self._nodes_waiting()
        if leave:
            self.set_state(JobState.RESIZING)
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

    def set_state(self, state: JobState) -> None:
        if state is not self.state or state is JobState.RENDEZVOUS:
            self.state = state
            self.board.publish(state=state, finished=time.time() if state.is_final else None)
            self.emit(StateChanged(state))

