"""What follows a group that ended on this machine: a restart (counted against
--max-restarts), a worker slot that failed again left out while --min-nproc allows (as Horovod's
blacklist does; no restart), a new round, or the end; and the record of what the job goes on
without. The rule itself is ``policy.after_group``; this keeps the count and the slots."""

from __future__ import annotations

from ...result import RankFailure
from ...spec import JobSpec
from ...wire.events import EventSink, Excluded, MembershipChanged
from ..machines.roles import SingleMachine
from ..policy import (
    FollowUp,
    GroupOutcome,
    Membership,
    after_group,
    blames_the_slot,
    own_failure,
)
from ..status import StatusBoard


class Recovery:
    """One job's restarts and left-out slots on this machine."""

    def __init__(self, spec: JobSpec, membership: Membership, role: SingleMachine,
                 board: StatusBoard, emit: EventSink) -> None:
        self.spec = spec
        self.membership = membership
        self.role = role  # it knows the machines the job went on without
        self.board = board
        self.emit = emit
        self.restarts = 0

    def after_group(self, step: GroupOutcome, failures: list[RankFailure],
                    ranks: tuple[int, ...]) -> FollowUp:
        """What follows a group of ``ranks`` (this machine's) that ended with ``step``; the
        slot of the rank that failed of itself, if it is left out, stays out until the user
        names it back (a scale with ``include``)."""
        mine = [f for f in failures if f.rank in ranks] if step is GroupOutcome.FAILED else []
        cause = own_failure(mine)
        membership = self.membership
        # the cell's own error would fail on any slot: it restarts or ends the job
        slot = membership.slots[cause.local_rank] if cause and blames_the_slot(cause) \
            else None
        next_ = after_group(
            step, self.restarts, self.spec.max_restarts,
            failed_before=slot is not None and membership.failed_before(slot),
            can_shrink=slot is not None and membership.nproc > self.spec.min_nproc)
        if next_ is FollowUp.EXCLUDE and cause and slot is not None:
            again = "failed again after a restart" if self.restarts \
                else "failed, no restart left"
            why = f"{again} (rank {cause.rank}: {cause.headline})"
            self.emit(MembershipChanged(*membership.exclude(slot, why)))
            self.emit(Excluded(f"slot {slot} of this machine", why, goes_on=True))
            self.board.publish(excluded=tuple(self.excluded()))
        return next_

    def count_restart(self) -> None:
        self.restarts += 1
        self.board.publish(restarts=self.restarts)

    def excluded(self) -> list[str]:
        """What the job goes on without, and why: other machines, this machine's slots."""
        return [*self.role.excluded, *(f"slot {slot} of this machine: {why}"
                                       for slot, why in self.membership.excluded.items())]
