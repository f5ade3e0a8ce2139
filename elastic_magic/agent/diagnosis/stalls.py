"""Which rank a hang is about: decisions from what the agent knows of each rank (how long
since it last made progress, whether it has finished, where its stacks say it is). Pure
values in, values out, tested without processes (tests/test_stalls.py).

Progress is what a worker reports: its main thread's Python position changed (sampled twice
a second), it printed a line, or it asked for State. A rank waiting in a collective makes no
progress either, so a quiet rank is only the cause when it is *outside* a collective; the
ranks waiting in one are consequences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ...stacks import RankActivity, RankPosition

# Below this, a rank outside a collective was still busy (it lagged) rather than stalled.
STILL_BUSY = 2.0


@dataclass(frozen=True)
class RankView:
    """One rank as the hang watchdog sees it: how long it has been quiet, whether its cell
    returned, and where its stacks put it."""

    rank: int
    quiet_for: float  # seconds since its last progress
    finished: bool = False  # it has reported its result (its cell returned)
    place: RankPosition | None = None  # where its stacks say it is; None: not asked


class HangKind(Enum):
    """Which kind of hang a verdict names: it decides who is a cause and how that is worded."""

    NONE = "none"  # nothing to name: keep waiting, or nothing explains the failure
    STALLED = "stalled"  # ranks stuck (or still busy) outside any collective
    LEFT_EARLY = "left_early"  # ranks returned while others waited in a collective
    ALL_WAITING = "all_waiting"  # every running rank waits in a collective


@dataclass(frozen=True)
class HangDiagnosis:
    """A verdict on a hang: its kind, the ranks that caused it and the ranks that only waited."""

    kind: HangKind
    causes: tuple[int, ...] = ()  # the root cause first
    waiting: tuple[int, ...] = ()  # ranks waiting in a collective: consequences


NOTHING = HangDiagnosis(HangKind.NONE)


def _in_collective(view: RankView) -> bool:
    return view.place is not None and view.place.where is RankActivity.COLLECTIVE


def _outside(view: RankView) -> bool:
    """Not in a collective: somewhere of its own, or not answering (None counts as not
    answering once stacks were asked for)."""
    return not view.finished and not _in_collective(view)


def _longest_quiet_first(views: Sequence[RankView]) -> tuple[int, ...]:
    return tuple(v.rank for v in sorted(views, key=lambda v: (-v.quiet_for, v.rank)))


def quiet_ranks(views: Sequence[RankView], stall_timeout: float) -> tuple[int, ...]:
    """Running ranks without progress for ``stall_timeout`` seconds: time to ask for stacks."""
    return tuple(v.rank for v in views if not v.finished and v.quiet_for >= stall_timeout)


def judge_stall(views: Sequence[RankView], stall_timeout: float,
                all_waiting_after: float) -> HangDiagnosis:
    """The watchdog's decision, once the quiet ranks' stacks are in.

    A quiet rank outside any collective stalled (the one quiet longest first). Else, when
    ranks wait in a collective while another rank has already returned, it left early.
    Else, when every running rank waits in a collective and none has moved for
    ``all_waiting_after`` seconds, nothing can complete: a mismatched collective, or a lost
    peer (the agent of a machine among several passes infinity: the ranks its own wait for
    may be busy on another machine). Otherwise someone is still working: keep waiting."""
    running = [v for v in views if not v.finished]
    quiet = [v for v in running if v.quiet_for >= stall_timeout]
    if not quiet:
        return NOTHING
    waiting = tuple(v.rank for v in running if _in_collective(v))
    stuck = [v for v in quiet if _outside(v)]
    if stuck:
        return HangDiagnosis(HangKind.STALLED, _longest_quiet_first(stuck), waiting)
    finished = tuple(v.rank for v in views if v.finished)
    if finished and waiting:
        return HangDiagnosis(HangKind.LEFT_EARLY, finished, waiting)
    if len(waiting) == len(running) and all(v.quiet_for >= all_waiting_after
                                            for v in running):
        odd = odd_one_out(running)
        return HangDiagnosis(HangKind.ALL_WAITING, odd, tuple(r for r in waiting if r not in odd))
    return NOTHING


def judge_failure(views: Sequence[RankView], timed_out: Sequence[int] = ()) -> HangDiagnosis:
    """After ranks (``timed_out``) reported a timeout or a lost peer, with the stacks of the
    ranks still alive: a rank that never reached the collective (outside one, stuck or busy)
    is the cause; else a rank that had already returned; else nothing explains it further."""
    outside = [v for v in views if _outside(v)]
    waiting = tuple(sorted({*timed_out, *(v.rank for v in views if _in_collective(v))}))
    if outside:
        return HangDiagnosis(HangKind.STALLED, _longest_quiet_first(outside), waiting)
    finished = tuple(v.rank for v in views if v.finished)
    if finished:
        return HangDiagnosis(HangKind.LEFT_EARLY, finished, waiting)
    return NOTHING


def odd_one_out(views: Sequence[RankView]) -> tuple[int, ...]:
    """Among ranks that all wait in collectives: those in a collective (or at a line) that
    fewer ranks wait in, when one such group is smallest; else the rank quiet longest."""
    def spot(v: RankView) -> tuple[str, int | None]:
        return (v.place.operation, v.place.cell_line) if v.place else ("", None)

    counts = Counter(spot(v) for v in views)
    if len(counts) > 1:
        fewest = min(counts.values())
        smallest = [s for s, n in counts.items() if n == fewest]
        if len(smallest) == 1:
            return tuple(sorted(v.rank for v in views if spot(v) == smallest[0]))
    return _longest_quiet_first(views)[:1]


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) != 1 else ''} {', '.join(map(str, ranks))}"


def cause_reason(verdict: HangDiagnosis, view: RankView,
                 places: dict[int, RankPosition] | None = None) -> str:
    """Why ``view``'s rank is a root cause of ``verdict``; the first clause (before ":") is
    what consequences refer to ("after rank 1 stalled")."""
    waiting = [r for r in verdict.waiting if r != view.rank]
    while_ = f", while {_ranks(waiting)} waited in one" if waiting else ""
    quiet = f"{view.quiet_for:.0f}s"
    if verdict.kind is HangKind.LEFT_EARLY:
        return f"returned early: its cell finished while {_ranks(waiting)} waited in a collective"
    if verdict.kind is HangKind.ALL_WAITING:
        others = {p.operation for r, p in (places or {}).items()
                  if r not in verdict.causes and p.operation}
        operation = view.place.operation if view.place else "?"
        if others and operation not in others:
            return (f"called a different collective: {operation}, while "
                    f"{_ranks(waiting)} wait in {', '.join(sorted(others))}")
        return (f"waited with every rank: {operation} for {quiet} with no rank moving (a "
                "lost peer, or ranks calling collectives in a different order)")
    if view.place is None or view.place.where is RankActivity.SILENT:
        return (f"stalled: no progress for {quiet} and no answer when asked for its stack "
                "(stuck in C code that holds the GIL?)")
    if view.quiet_for < STILL_BUSY:
        return f"lagged behind: still busy outside any collective{while_}"
    return f"stalled: no progress for {quiet}, outside any collective{while_}"


def waiting_reason(place: RankPosition | None) -> str:
    operation = place.operation if place and place.operation else "a collective"
    return f"waited in {operation}"
