"""Survivors stay (``--survivors``), the agent's side on this machine: after a failure
or at a resize, the ranks that are still healthy leave their payload without leaving their
process, and wait, parked, for the next group; only the others are stopped.

A rank leaves on its own when its collective errors (gloo, once a dead peer's socket
closes), or at a commit that applies a resize; the others are told (``Interrupt``). Which
ranks stay: those alive and parked whose error, if any, was a consequence (a lost peer).
A rank that failed of itself is stopped at once (its peers' collectives then fail) and
replaced, as by a restart; one that did not park within the time given (stuck in a
collective that does not error) too, and its failure says why. A rank that has ended
is not waited for while its shepherd ends what it left (DataLoader workers, 10-15 ms
each): the survivors park and the next round forms meanwhile, and the next group starts
once it is done (``Survivors.bury``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection

from ...result import RankFailure, is_consequence
from ...wire.messages import Interrupt
from .group import WorkerGroup
from .workers import TEARDOWN_ESCALATION, Worker, join_threads, stop

STUCK = ("did not leave its collective (within the link timeout, or a second after the "
         "last other rank left): stopped and started again")
# No rank left, and none still in its payload reported, for this long: those wait for no
# one (gloo does not wake a collective whose peers left without closing their
# connections). A rank that reports (its commit in flight, which holds the agent's word
# until its send has started) is not stuck, however loaded the machine.
NO_PROGRESS = 1.0


def ask_to_leave(group: WorkerGroup) -> None:
    """Every live rank that has not parked yet leaves its payload now."""
    for worker in group.workers:
        if not worker.parked and worker.alive():
            worker.send(Interrupt(group_ends=True))


def settled(group: WorkerGroup) -> bool:
    """Every rank has parked or ended."""
    return all(w.parked or not w.alive() for w in group.workers)


def failed_of_itself(worker: Worker, session: bool = False) -> bool:
    """It reported an error of its own, not the loss of a peer (a session's rank keeps its
    namespace whatever its cell raised: it answered, so it is healthy)."""
    return not session and worker.error is not None and not is_consequence(worker.failure())


def stays(worker: Worker, session: bool = False) -> bool:
    """A parked rank, alive, that did not fail of itself. Alive is the rank itself: its
    report pipe open (its shepherd outlives a killed worker while it ends what it left)."""
    return worker.parked and worker.alive() and worker.ended_at is None \
        and not failed_of_itself(worker, session)


@dataclasses.dataclass
class SortedRanks:
    """What ``keep_survivors`` leaves: the survivors by slot, the ranks that had ended
    (their shepherds may still end what they left), and the failures of the ranks stopped
    for not parking."""

    survivors: dict[int, Worker]
    ended: list[Worker]
    stuck: list[RankFailure]


def keep_survivors(group: WorkerGroup, wait: Callable[[float], object], timeout: float,
                   session: bool = False) -> SortedRanks:
    """Ask the ranks to leave, give them ``timeout`` seconds to park (``wait(seconds)``
    serves the inbox meanwhile: their reports and their last commits), or NO_PROGRESS
    seconds after the last rank left and the last report of those still in their payload;
    stop the others. ``session``: a session's group,
    whose ranks park by answering their cell (an idle rank is parked)."""
    ask_to_leave(group)
    deadline = time.monotonic() + timeout
    left_count, last_left = -1, time.monotonic()
    while True:
        # A rank that failed of itself goes at once: its peers may wait for it in a
        # collective, which fails only when its sockets close.
        if own := [w for w in group.workers if w.alive() and failed_of_itself(w, session)]:
            stop(own, TEARDOWN_ESCALATION)
        now = time.monotonic()
        if (count := sum(w.parked or not w.alive() for w in group.workers)) != left_count:
            left_count, last_left = count, now
        heard = max((w.heard_at for w in group.workers if w.alive() and not w.parked),
                    default=0.0)
        if settled(group) or now >= deadline or (
                count and now - max(last_left, heard) >= NO_PROGRESS):
            break
        wait(min(deadline - now, 0.05))
    stuck = [w for w in group.workers if w.alive() and not w.parked]
    survivors = {w.slot: w for w in group.workers
                 if stays(w, session) and w.slot is not None}
    gone = [w for w in group.workers if w.slot not in survivors]
    running: list[Worker] = []
    ended: list[Worker] = []
    for worker in gone:
        (running if worker.alive() else ended).append(worker)
    stop(running, TEARDOWN_ESCALATION)
    join_threads(running, timeout=2.0)
    return SortedRanks(survivors, ended, [dataclasses.replace(w.failure(), reason=STUCK,
                                                       consequence=True) for w in stuck])


def bury(workers: list[Worker]) -> None:
    """Ranks that ended: wait until nothing of them is left, and their output is in."""
    stop(workers, TEARDOWN_ESCALATION)
    join_threads(workers, timeout=2.0)
    workers.clear()


def release(survivors: dict[int, Worker]) -> None:
    """Survivors the next group does not take (a smaller group, a rank renumbered): they
    end as a finished group's workers do."""
    workers = list(survivors.values())
    survivors.clear()
    bury(workers)


class Survivors:
    """The parked ranks one group leaves to the next on this machine (one-shot jobs and
    sessions; a job of several machines keeps them on each machine)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.kept: dict[int, Worker] = {}  # by slot
        self.ended: list[Worker] = []  # ranks of the group before that had ended
        self._offered: list[Worker] = []  # offered to the group being started
        self.stayed: tuple[int, ...] = ()  # the ranks that stayed in the last group started

    def offer(self, session: bool) -> bool:
        """Before ``WorkerGroup.start`` (given ``kept``): whether its ranks park when they
        leave a payload (a one-shot job's); a session's ranks wait between cells anyway."""
        self._offered = list(self.kept.values())
        return self.on and not session

    def started(self, group: WorkerGroup) -> tuple[int, ...]:
        """Once the group started: the ranks that stayed; the survivors it did not take
        are released."""
        release(self.kept)
        offered, self._offered = self._offered, []
        self.stayed = tuple(w.global_rank for w in group.workers
                            if any(w is o for o in offered))
        return self.stayed

    def keep(self, group: WorkerGroup, wait: Callable[[float], object], timeout: float,
             session: bool = False) -> list[RankFailure]:
        """``keep_survivors``: they are kept for the next group."""
        kept = keep_survivors(group, wait, timeout, session)
        self.kept = kept.survivors
        self.ended.extend(kept.ended)
        return kept.stuck

    def drop(self, ranks: Collection[int]) -> None:
        """The kept ranks among ``ranks`` (global ranks of the group they left) end: a
        session's rank whose setup replay a peer's death cut short lacks what it makes."""
        dropped = {slot: w for slot, w in self.kept.items() if w.global_rank in ranks}
        for slot in dropped:
            del self.kept[slot]
        release(dropped)

    def bury(self) -> None:
        """Before the next group starts (or the job ends): nothing is left of the ranks
        that ended, and their output is in, before the next group's."""
        bury(self.ended)

    def release(self) -> None:
        self.bury()
        release(self.kept)

    def spare(self, keep: bool) -> list[Worker]:
        """The survivors kept for the next group (``keep``), or none: they are released.
        The ranks that had ended are buried either way."""
        self.bury()
        if not keep:
            self.release()
        return list(self.kept.values())
