"""The agent's decisions, apart from the mechanisms they steer: what to do while a group
runs, after it ends, and when membership changes. Pure values in, values out, so every rule
is tested without processes (tests/test_policy.py)."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from ..result import JobState, RankFailure, is_consequence
from ..wire.messages import Action


@dataclass(frozen=True)
class GroupStatus:
    """What ``WorkerGroup.poll()`` saw: a value, decided on by the loop."""

    failed: bool = False  # a worker reported an error, or died with a non-zero code
    succeeded: bool = False  # every worker reported its result
    resized: bool = False  # every worker left at a commit that applied a resize
    running: bool = False  # every worker is in user code


class GroupOutcome(Enum):
    """What the loop does next while a group runs."""

    WAIT = "wait"
    STOP = "stop"  # a stop request: interrupt the workers, end the job
    REGROUP = "regroup"  # membership changes now: stop the group, next round
    NODE_FAILED = "node_failed"  # another machine failed for good: end here too
    FAILED = "failed"  # tear the group down at once; restart if allowed
    SUCCEEDED = "succeeded"
    RESIZED = "resized"  # every rank left at a commit: next round at the new size


def during_group(action: Action | None, regroup_due: bool, status: GroupStatus) -> GroupOutcome:
    """Commands first (a stop beats everything), then membership, then the group itself."""
    if action is Action.STOP:
        return GroupOutcome.STOP
    if action is Action.NODE_FAILED:  # no regroup can save a job whose machine is done
        return GroupOutcome.NODE_FAILED
    if action is Action.REGROUP or regroup_due:
        return GroupOutcome.REGROUP
    if status.failed:
        return GroupOutcome.FAILED
    if status.succeeded:
        return GroupOutcome.SUCCEEDED
    if status.resized:
        return GroupOutcome.RESIZED
    return GroupOutcome.WAIT


_URGENCY = {None: 0, Action.REGROUP: 1, Action.NODE_FAILED: 2, Action.STOP: 3}


def most_urgent(a: Action | None, b: Action | None) -> Action | None:
    """Of two actions asked for, the one to carry out."""
    return a if _URGENCY[a] >= _URGENCY[b] else b


def own_failure(failures: list[RankFailure]) -> RankFailure | None:
    """The first rank that failed of itself (an error or exit of its own), not one that
    lost its peers or that the agent's hang diagnosis named; else the root cause."""
    own = (f for f in failures if f.reason is None and not is_consequence(f))
    return next(own, failures[0] if failures else None)


# What a device says when it, not the cell's code, is at fault: torch raises CUDA's errors as
# AcceleratorError (older torch: RuntimeError) and NCCL's as errors whose message names them.
# Running out of memory is the batch's size, not the GPU's fault.
_DEVICE_ERROR_MARKERS = ("CUDA error", "NCCL error", "ECC error", "cudaError",
                         "device-side assert", "unhandled system error")


def blames_the_slot(failure: RankFailure) -> bool:
    """Whether ``failure`` is evidence against the worker slot (its GPU) rather than against
    the cell: the process died (a signal, an exit code) or its device reported an error.
    An exception of the cell's own code (a NameError, a framework's configuration error),
    or what the agent found it doing (stalled, returned while others waited), would follow
    the cell to any slot: leaving a slot out for it would only shrink the job and hide the
    error."""
    if failure.reason is not None or is_consequence(failure):  # a peer's death: not ours
        return False
    if failure.exc_type is None:
        return True
    if "out of memory" in failure.message:  # "CUDA error: out of memory" too: the batch
        return False
    return failure.exc_type == "AcceleratorError" or any(
        m in failure.message for m in _DEVICE_ERROR_MARKERS)


class FollowUp(Enum):
    """What follows a group that has ended."""

    END = "end"
    RESTART = "restart"  # counts against --max-restarts
    NEW_ROUND = "new_round"  # a membership change: does not count
    EXCLUDE = "exclude"  # go on without the failing slot, from the last commit: no restart


def what_ended(step: GroupOutcome, heard: Action | None) -> GroupOutcome:
    """What ended the group, counting what was ``heard`` (the most urgent command) while it
    was torn down: a stop, or another machine's failure for good, outranks a restart or a
    new round; a membership change (a machine left or was lost) makes a failure a
    consequence of it: a regroup."""
    if step is GroupOutcome.SUCCEEDED:
        return step
    if heard is Action.STOP:
        return GroupOutcome.STOP
    if heard is Action.NODE_FAILED:
        return GroupOutcome.NODE_FAILED
    if step is GroupOutcome.FAILED and heard is Action.REGROUP:
        return GroupOutcome.REGROUP
    return step


def after_group(step: GroupOutcome, restarts_used: int, max_restarts: int, *,
                failed_before: bool = False, can_shrink: bool = False) -> FollowUp:
    """``failed_before``: the failing slot (the root cause's) failed in an earlier attempt;
    ``can_shrink``: one worker fewer is within the job's bounds (--min-nproc). Such a slot
    is excluded when it fails again after a restart, or when no restart is left; a first
    failure with restarts left restarts the group (most failures are transient)."""
    if step in (GroupOutcome.REGROUP, GroupOutcome.RESIZED):
        return FollowUp.NEW_ROUND
    if step is GroupOutcome.FAILED and can_shrink and (failed_before
                                               or restarts_used >= max_restarts):
        return FollowUp.EXCLUDE
    if step is GroupOutcome.FAILED and restarts_used < max_restarts:
        return FollowUp.RESTART
    return FollowUp.END  # another machine's failure for good ends the job whatever is left


def final_state(step: GroupOutcome) -> JobState:
    """How the job ends after a group that ended with ``step`` (and no new round)."""
    if step is GroupOutcome.SUCCEEDED:
        return JobState.SUCCEEDED
    if step is GroupOutcome.STOP:
        return JobState.STOPPED
    return JobState.FAILED


class Resize(Enum):
    """When a requested worker count takes effect: never (no change), at the next commit, or
    at once, losing the steps since the last one."""

    NONE = "none"  # already that size
    AT_COMMIT = "at_commit"  # every rank leaves at the next commit
    NOW = "now"  # stop the group; the next round resumes from the last commit


@dataclass
class Membership:
    """This machine's worker count, the resize waiting to be applied, and its worker
    slots: slot ``s`` is GPU ``s`` (or the s-th CPU worker). Local ranks are renumbered
    from 0 in every group; slots are not, so a slot that keeps failing can be named and
    left out. The group's slots are the ``nproc`` lowest that are not excluded; an excluded
    slot stays out at every size until the user names it back (``request(include=...)``)."""

    nproc: int
    pending: int | None = None
    resizes: int = 0
    excluded: dict[int, str] = field(default_factory=dict)  # slot -> why it is out
    failed: set[int] = field(default_factory=set)  # slots that failed in some attempt
    returning: set[int] = field(default_factory=set)  # excluded slots named back

    @property
    def slots(self) -> list[int]:
        usable = (s for s in itertools.count() if s not in self.excluded)
        return list(itertools.islice(usable, self.nproc))

    def failed_before(self, slot: int) -> bool:
        """Note that ``slot`` failed; whether it had failed before."""
        before = slot in self.failed
        self.failed.add(slot)
        return before

    def exclude(self, slot: int, why: str = "") -> tuple[int, int]:
        """Go on without ``slot``: (old, new) worker count."""
        self.excluded[slot] = why
        self.nproc -= 1
        return self.nproc + 1, self.nproc

    def request(self, target: int, *, graceful: bool, include: Collection[int] = ()
                ) -> Resize:
        """Note a resize to ``target``, with the excluded slots in ``include`` back in:
        applied at the next commit when ``graceful`` (no step lost), else now."""
        back = set(include) & self.excluded.keys()
        if target == self.nproc and self.pending is None and not back:
            return Resize.NONE
        self.pending = target
        self.returning |= back
        return Resize.AT_COMMIT if graceful else Resize.NOW

    @property
    def resize_pending(self) -> bool:
        return (self.pending is not None and self.pending != self.nproc) \
            or bool(self.returning)

    def apply(self) -> tuple[int, int] | None:
        """Before a new round: take the pending size and the slots named back; (old, new)
        when the group changes."""
        old, new = self.nproc, self.pending
        back, self.pending, self.returning = self.returning, None, set()
        for slot in back:  # a fresh start: its earlier failures are forgotten
            del self.excluded[slot]
            self.failed.discard(slot)
        if new is None or (new == old and not back):
            return None
        self.nproc = new
        self.resizes += 1
        return old, new


@dataclass
class RegroupClock:
    """torch's waiting-node mechanism: when a machine waits for the next round, every
    machine leaves its group and re-rendezvous. A group with State first gets
    ``graceful_wait`` seconds to leave at its next commit (which then answers "resize").
    The rendezvous is asked at most every ``check_interval`` seconds (a store read)."""

    check_interval: float = 0.5
    graceful_wait: float = 10.0
    _next_check: float = 0.0
    _due_at: float | None = None

    def due(self, now: float, nodes_waiting: bool | None, graceful: bool) -> bool:
        """``nodes_waiting`` is None when the check is skipped (see :meth:`check_now`)."""
        if nodes_waiting is None:
            return self._due_at is not None and now >= self._due_at
        self._next_check = now + self.check_interval
        if not nodes_waiting:
            self._due_at = None
            return False
        if self._due_at is None:
            self._due_at = now + (self.graceful_wait if graceful else 0.0)
        return now >= self._due_at

    def check_now(self, now: float) -> bool:
        return now >= self._next_check

    def reset(self) -> None:
        self._due_at = None


# -- sessions: one cell on a live group --------------------------------------------------


@dataclass(frozen=True)
class CellStatus:
    """Where a session's cell stands on this machine (``agent/loop/cell_runner.py``)."""

    died: bool = False  # a worker process ended: the group cannot run the next cell
    reported: bool = False  # every rank reported its value or its error, output included
    errors: bool = False  # some rank reported an error (it lives on)
    resized: bool = False  # every rank left at a commit that applied a resize
    stalled: bool = False  # the stall watchdog named a rank (--stall-timeout)


class CellStep(Enum):
    """What the session does next while a cell runs."""

    WAIT = "wait"
    INTERRUPT = "interrupt"  # KeyboardInterrupt in the ranks still running the cell
    DONE = "done"  # every rank answered: the cell is over, the group lives on
    BROKEN = "broken"  # tear the group down; the session re-forms before the next cell
    RESIZED = "resized"  # every rank left at a commit: re-form at the new size, go on
    STOP = "stop"  # the session ends


def during_cell(action: Action | None, status: CellStatus, *, interrupt: bool,
                interrupted_for: float | None, grace: float) -> CellStep:
    """A stop first (a resize waits for the cell's end or its next commit); then a rank
    that died or stalled; then the ranks' answers. A rank that raised, or
    a Ctrl-C, interrupts the others (they may wait for it in a collective); ranks that have
    not answered ``grace`` seconds after the interrupt are stuck: the group is re-formed.
    ``interrupted_for``: seconds since the interrupt was sent (None: not sent)."""
    if action is Action.STOP:
        return CellStep.STOP
    if status.died or status.stalled:
        return CellStep.BROKEN
    if status.resized:
        return CellStep.RESIZED
    if status.reported:
        return CellStep.DONE
    if interrupted_for is not None:
        return CellStep.BROKEN if interrupted_for >= grace else CellStep.WAIT
    if status.errors or interrupt:
        return CellStep.INTERRUPT
    return CellStep.WAIT


def cell_state(step: CellStep, failures: list[RankFailure], *, interrupted: bool,
               stuck: Collection[int] = ()) -> JobState:
    """How a session's cell ends. It succeeded only when every rank answered and none
    failed: a group that broke (a rank died, or did not come back from an interrupt) fails
    the cell, whatever the ranks that answered said. It was interrupted when every rank that
    failed of itself raised KeyboardInterrupt, or when none did and ranks (``stuck``, their
    failures among ``failures``) did not come back from the user's interrupt
    (``interrupted``)."""
    if step is CellStep.STOP:
        return JobState.STOPPED
    own = [f for f in failures if f.rank not in stuck]
    if all(f.exc_type == "KeyboardInterrupt" for f in own) and (own or (stuck and interrupted)):
        return JobState.STOPPED
    if step is CellStep.DONE and not failures:
        return JobState.SUCCEEDED
    return JobState.FAILED
