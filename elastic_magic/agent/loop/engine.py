"""The engine: one job's worker groups on this machine, whichever loop drives them.

It owns what a group's life takes, and nothing of the decisions between groups: the
rendezvous round, starting the group, the inbox (commands, worker reports, other machines),
the job's state, tearing a group down, what follows a failure here (restart, or a slot left
out), the result, and releasing everything at the end (a finished job holds nothing but its
result: a notebook runs hundreds of cells).
The one-shot loop (``job_loop``) and a session's loops (``session_loop``,
``session_joined``) each hold an engine; none inherits another's loop.

A loop's own inbox items (a session's cells, its interrupts) are handed to the loop first
(``switchboard.loop_items``), wherever the inbox is read (a round, a teardown, the other
machines' results): they are never lost while the engine waits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from ...logs import RunFolder, is_default, prune
from ...result import JobResult, JobState, MemorySnapshot, RankFailure
from ...spec import JobSpec
from ...wire.events import (
    EventSink,
    HeldOutput,
    JobFinished,
    MembershipChanged,
    RendezvousCompleted,
    ResizeRequested,
    StateChanged,
    WorkersStarted,
)
from ...wire.link_messages import NodeRequest, Regroup
from ...wire.messages import Action, Result, Running, ScaleCommand, StopCommand
from ...wire.metrics import Logged, MetricsKept
from ...wire.payload import Payload
from ...wire.protocol import new_secret
from ..diagnosis.hangs import HangWatch
from ..diagnosis.stack_requests import StackRequests
from ..inbox import FromLink, Inbox, InboxItem, WorkerReport
from ..job_result import assemble_result
from ..machines.rendezvous import Rendezvous
from ..machines.roles import SingleMachine
from ..node.environment import torchrun_env
from ..node.group import WorkerGroup
from ..node.pool import warm_pool
from ..node.survivors import Survivors
from ..node.workers import Worker
from ..node.zygote_link import PoolError
from ..policy import FollowUp, GroupOutcome, Membership, Resize
from ..round_info import RoundInfo
from ..status import StatusBoard
from .recovery import Recovery
from .state_keeper import StateKeeper
from .switchboard import Switchboard

# Makes one attempt's workers on this machine: (attempt, base rank, nproc). Tests give a
# scripted group here, as torch tests its rendezvous with a fake state holder.
GroupFactory = Callable[[int, int, int], WorkerGroup]
Results = tuple[dict[int, Result], dict[int, list[str]]]  # other machines' ranks


class EarlyRegroups:
    """Regroups that name another round than this machine's. One for a round it has left is
    dropped: sent as it joined its next round, a loaded machine may read it only there, and
    it must not break that round. One for the round it is entering (the head regrouped
    before this machine had left its rendezvous) waits for that round's group, and ends it."""

    def __init__(self) -> None:
        self._held: dict[str, InboxItem] = {}

    def hold(self, item: InboxItem, info: RoundInfo | None) -> bool:
        """Whether ``item`` is a Regroup for another round (kept until the next one)."""
        if not (isinstance(item, FromLink) and isinstance(item.message, Regroup)):
            return False
        if info is not None and item.message.round_id == info.round_id:
            return False
        self._held[item.message.round_id] = item
        return True

    def for_round(self, info: RoundInfo) -> InboxItem | None:
        """The Regroup for round ``info`` heard before it, if any; the others are dropped."""
        early = self._held.pop(info.round_id, None)
        self._held.clear()
        return early


# What ends a wait for the next round (besides this machine being given back at a commit).
_ENDS_WAIT = (Action.STOP, Action.NODE_FAILED)


class Engine:
    """One job's worker groups on this machine (see the module's docstring)."""

    def __init__(self, spec: JobSpec, payload: Payload, run_id: str, emit: EventSink,
                 inbox: Inbox, board: StatusBoard, role: SingleMachine, *,
                 new_group: GroupFactory = WorkerGroup) -> None:
        self.spec = spec
        self.payload = payload  # what every group starts with
        self.run_id = run_id
        self.emit = emit
        self.inbox = inbox
        self.board = board
        self.role = role
        self.new_group = new_group
        self.metrics = MetricsKept()  # what the ranks logged: assemble's taps the sink
        self.switchboard = Switchboard(inbox, self._dispatch, self._check_store)
        self.key = new_secret()
        self.log_root = spec.log_dir / run_id
        self.run_folder: RunFolder | None = None  # held while the job runs (logs.RunFolder)
        self.stack_requests = StackRequests(role)
        self.hangs = HangWatch(spec, emit, self.stack_requests)  # stalls, early exits
        self.elastic_state = StateKeeper(spec, role, board, emit, self._leave_at_commit)
        self.membership = Membership(spec.nproc)
        self.recovery = Recovery(spec, self.membership, role, board, emit)  # restarts, slots
        self.survivors = Survivors(spec.survivors)  # --survivors: healthy ranks stay
        self.rendezvous: Rendezvous | None = None
        self.round: RoundInfo | None = None
        self.early_regroups = EarlyRegroups()
        self.group: WorkerGroup | None = None
        self.state = JobState.RENDEZVOUS
        self.attempt, self.world_size = -1, 0
        self.failures: list[RankFailure] = []
        self.stop_reason: str | None = None

    # -- a group's life -------------------------------------------------------------------

    def open(self) -> None:
        """What a job holds before its first round: its run's log folder (first, so no prune
        takes it; a joined machine's may come from another agent of the job on this host),
        the checkpoint it resumes from, the rendezvous, a joining machine's warm pool."""
        self.run_folder = RunFolder.open(self.log_root, fresh=self.role.hosts_rendezvous)
        if is_default(self.spec.log_dir):
            prune(self.spec.log_dir)
        self.elastic_state.resume()
        self.rendezvous = self.role.open()
        self.board.publish(join_command=self.role.join_command)
        _warm_before_joining(self)

    def apply_resize(self) -> None:
        """Before a round: the size asked for, and the slots named back, take effect."""
        if change := self.membership.apply():
            self.emit(MembershipChanged(*change))

    def next_round(self) -> RoundInfo | None:
        """Join the next round, serving the inbox meanwhile. None when a stop (or another
        machine's failure for good) came first, or a joined machine finds the job ended."""
        assert self.rendezvous is not None
        try:
            info = self.rendezvous.next_round_unless(
                self.membership.nproc,
                lambda: self.switchboard.drain() in _ENDS_WAIT or self.role.leaves_before_round(),
                self.spec.monitor_interval, cancel=self.role.hosts_rendezvous)
        except RendezvousClosedError:
            if self.role.hosts_rendezvous:
                raise
            self.stop_reason = "the job ended before this machine joined a round"
            return None
        if info is not None:
            self.round = info
            self.emit(RendezvousCompleted(info.round, info.node_rank, info.nnodes, info.world_size,
                                          info.master_addr, info.master_port, info.machines))
        return info

    def start_group(self, info: RoundInfo) -> None:
        """This machine's workers of round ``info``, running ``payload``."""
        self.survivors.bury()  # nothing left of the ranks that ended, their output in
        self.attempt, self.world_size, self.failures = self.attempt + 1, info.world_size, []
        self.switchboard.new_group()
        self.set_state(JobState.STARTING)
        nproc, slots = self.membership.nproc, self.membership.slots
        group = self.group = self.new_group(self.attempt, info.base_rank, nproc)
        if (early := self.early_regroups.for_round(info)) is not None:
            self.inbox.put(early)  # read once the group runs: it ends the group at once
        run_folder = self.run_folder
        assert run_folder is not None  # open() came first

        def env_for(w: Worker) -> dict[str, str]:
            return torchrun_env(w, info, self.spec, nproc=nproc, run_id=self.run_id,
                                restart_count=self.restarts, network=self.role.network,
                                error_file=run_folder.error_file(self.attempt, w.global_rank),
                                slots=slots)

        with HeldOutput(self.emit) as output:
            group.start(self.payload, env_for, cwd=self.payload.cwd, key=self.key,
                        run_folder=run_folder, inbox=self.inbox,
                        emit=self.hangs.noting_output(output), pool=self.spec.pool,
                        preload=self.spec.preload, slots=slots, survivors=self.survivors.kept,
                        stay=self.survivors.offer(self.payload.session))
            self.emit(WorkersStarted(self.attempt, self.restarts, group.ranks, group.pids,
                                     self.survivors.started(group)))
        self.board.publish(world_size=info.world_size, nnodes=info.nnodes,
                           restarts=self.restarts, **group.processes())

    def tear_down(self) -> tuple[float, list[RankFailure]]:
        """Stop the group at once (no waiting for collective timeouts; a commit in flight lands
        first): when, and the ranks that failed of themselves before, root cause first."""
        group = self.group
        assert group is not None
        self.elastic_state.let_commit_land(self.switchboard.next_action)
        group.await_the_gone(self.switchboard.next_action)  # a death is seen before it
        teardown_at = group.tear_down()
        self.switchboard.drain()
        return teardown_at, group.failures_before(teardown_at)

    def close_group(self, keep: bool = False) -> None:
        """No worker of the group left running; but, with ``keep``, the survivors kept."""
        spare = self.survivors.spare(keep)
        if self.group is not None:
            self.group.close(spare)
            self.board.publish(pids={}, shepherds={})

    def after_group(self, step: GroupOutcome) -> FollowUp:
        """What follows the group that ended with ``step`` (see ``recovery``)."""
        ranks = self.group.ranks if self.group is not None else ()
        return self.recovery.after_group(step, self.failures, ranks)

    restarts = property(lambda self: self.recovery.restarts)

    def set_state(self, state: JobState) -> None:
        if state is not self.state or state is JobState.RENDEZVOUS:
            self.state = state
            self.board.publish(state=state, finished=time.time() if state.is_final else None)
            self.emit(StateChanged(state))

    # -- the inbox ------------------------------------------------------------------------

    def _check_store(self) -> None:
        """Raises if the rendezvous store held a forgery (whichever thread read it)."""
        if self.rendezvous is not None:
            self.rendezvous.check()

    def _dispatch(self, item: InboxItem) -> Action | None:
        group = self.group
        if self.stack_requests.handle(item, group) or self.early_regroups.hold(item, self.round):
            return None
        match item:
            case StopCommand(reason):
                self.stop_reason = reason
                self.role.stop_requested(reason)
                return Action.STOP
            case ScaleCommand(nproc, immediate, include):
                graceful = self.graceful and not immediate
                verdict = self.membership.request(nproc, graceful=graceful, include=include)
                if verdict is not Resize.NONE:
                    self.emit(ResizeRequested(nproc, verdict is Resize.AT_COMMIT))
                return Action.REGROUP if verdict is Resize.NOW else None
            case WorkerReport(message=Logged() as logged):
                self.emit(logged)  # the dashboard's charts; the result's series
            case WorkerReport() if group is not None:
                if self.hangs.note(item, group):  # progress: for the hang watch alone
                    return None
                request = group.record(item)
                if isinstance(item.message, Running):  # its PID shown; once all run, told
                    self.board.publish(**group.processes())
                    if running := group.running_news():
                        self.emit(running)
                if request is not None:
                    self.elastic_state.serve(group.workers[item.local_rank], request,
                                             self.world_size)
                elif self.state is JobState.STARTING and group.running:
                    self.set_state(JobState.RUNNING)
            case FromLink():
                if isinstance(item.message, NodeRequest):
                    self.elastic_state.used = True  # another machine's ranks use State
                action = self.role.handle(item, group, self.elastic_state.server,
                                          self.world_size)
                if action is Action.STOP:
                    self.stop_reason = self.role.stop_reason
                return action
        return None

    # -- State and membership across machines -------------------------------------------

    @property
    def graceful(self) -> bool:
        """A membership change can wait for the group's next commit (or the one it leaves at)."""
        return self.elastic_state.used and self.state in (JobState.RUNNING, JobState.RESIZING)

    def _leave_at_commit(self) -> bool:
        """Every rank leaves at this commit when this machine resizes or others wait."""
        leave = self.role.take_release() or self.membership.resize_pending or self.nodes_waiting()
        if leave:
            self.set_state(JobState.RESIZING)
        return leave

    def nodes_waiting(self) -> bool:
        return self.rendezvous is not None and self.role.nodes_waiting(self.rendezvous)

    # -- the end --------------------------------------------------------------------------

    def result(self, state: JobState, failures: list[RankFailure], *, started: float,
               stop_reason: str | None, others: Results | None = None,
               snapshot: bytes | MemorySnapshot | None = None) -> JobResult:
        """The JobResult of the job, or of a session's cell: this machine's ranks and the
        others' (their results and output tails). Plain data: it cannot fail on a release."""
        group, (other_ranks, other_tails) = self.group, others or ({}, {})
        ranks, tails = (group.results(), group.tails()) if group is not None else ({}, {})
        return assemble_result(
            run_id=self.run_id, state=state, world_size=self.world_size,
            restarts=self.restarts, max_restarts=self.spec.max_restarts, started=started,
            log_dir=self.log_root, failures=failures, stop_reason=stop_reason,
            resizes=self.membership.resizes, commit=self.elastic_state.snapshots.meta,
            snapshot=snapshot, ranks={**ranks, **other_ranks},
            tails={**tails, **other_tails}, stacks=self.hangs.kept,
            excluded=self.recovery.excluded(), metrics=self.metrics.take())

    def finish(self, final: JobState) -> JobResult:
        """Release all the job held, tell the other machines (each step even if one raised),
        and report the job's result."""
        errors: list[BaseException] = []

        def attempt(release: Callable[[], object]) -> None:
            try:
                release()
            except Exception as exc:
                errors.append(exc)

        attempt(self.close_group)
        attempt(lambda: _release_run_folder(self))
        attempt(lambda: self.role.close_rendezvous(self.rendezvous))
        result: JobResult | None = None
        try:
            others = self.role.other_ranks(self.round) if final is JobState.SUCCEEDED else None
            result = self.result(final, self.failures, started=self.board.current.started,
                                 stop_reason=self.stop_reason, others=others,
                                 snapshot=self.elastic_state.kept())
        finally:
            attempt(self.stack_requests.close)
            attempt(self.elastic_state.close)
            attempt(lambda: self.set_state(final))
            attempt(lambda: self.role.finished(final, self.failures))
            if result is not None:
                attempt(lambda: self.emit(JobFinished(result)))
            self.rendezvous = self.group = None  # their stores and pipes go now
            self.switchboard.close()  # a finished job holds no cycle through its methods
        if errors:
            raise errors[0]
        return result


def _release_run_folder(engine: Engine) -> None:
    if (folder := engine.run_folder) is not None:
        engine.log_root, engine.run_folder = folder.where(), None  # the result: its logs
        folder.close()


def _warm_before_joining(engine: Engine) -> None:
    """A machine joining a running job starts its warm pool (Python, torch, the preload)
    before it joins a round: the running group trains on meanwhile, instead of waiting in
    the regroup that the join sets off while this machine's first workers start. The
    zygote's environment is what its workers will have, but for the per-round variables
    (``zygote_env``): a placeholder round gives those."""
    if engine.role.hosts_rendezvous or not engine.spec.pool:
        return
    nproc = engine.membership.nproc
    placeholder = RoundInfo(round=0, round_id="", node_rank=0, nnodes=1, base_rank=0,
                            world_size=nproc, master_addr="127.0.0.1", master_port=0)
    env = torchrun_env(Worker(0, 0, 0), placeholder, engine.spec, nproc=nproc,
                       run_id=engine.run_id, restart_count=0, error_file=Path(os.devnull),
                       network=engine.role.network, slots=engine.membership.slots)
    with contextlib.suppress(PoolError):  # the round starts fresh workers, as without it
        warm_pool().zygote_for(env, engine.payload.cwd, engine.payload.sys_path,
                               engine.spec.preload)
