"""Scalars a cell logs with ``elastic_magic.log``: what a rank reports (a batch of points,
sent at most twice a second and when its cell ends), told to the dashboard as an event of
the same shape, and the series a job keeps of them (``JobResult.metrics``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..result_parts import MetricSeries

Point = tuple[float, int, str, float]  # (time, step, name, value)
# Points a job keeps of one scalar, a rank: past it, the series thins (``Thinned``).
MAX_POINTS = 100_000
T = TypeVar("T")


class Thinned(Generic[T]):
    """Items kept within a bound, evenly over the whole run, the latest always among them:
    past ``most``, every other one kept is dropped, and from then on one new item in twice
    as many as before is kept (halving again would thin the early part only)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.kept: list[T] = []
        self.latest: T | None = None  # kept or not
        self._stride, self._seen = 1, 0

    def add(self, item: T) -> None:
        if self._seen % self._stride == 0:
            self.kept.append(item)
            if len(self.kept) > self.most:
                del self.kept[1::2]
                self._stride *= 2
        self._seen += 1
        self.latest = item

    def items(self) -> list[T]:
        """What was kept, the latest last."""
        if self.latest is None or (self.kept and self.kept[-1] is self.latest):
            return list(self.kept)
        return [*self.kept, self.latest]

    def __len__(self) -> int:
        return self._seen


@dataclass(frozen=True)
class Logged:
    """Rank ``rank`` logged ``points`` (a worker's report, and the event that tells it)."""

    rank: int
    points: tuple[Point, ...]

    @property
    def time(self) -> float:
        """When the last of them was logged (as every event has a time)."""
        return self.points[-1][0] if self.points else 0.0


class MetricsKept:
    """The series, by name, of the Logged events that pass the sink it taps (this
    machine's ranks' and, on a head, the other machines')."""

    def __init__(self) -> None:
        # each rank's points of a scalar thinned apart, so that one rank's never crowd
        # another's out: (arrival, step, value, time)
        self._series: dict[tuple[str, int], Thinned[tuple[int, int, float, float]]] = {}
        self._arrived = 0
        self._lock = threading.Lock()  # events come from the agent's and the pumps' threads

    def tap(self, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """``sink``, noting each Logged event on its way."""
        def tapped(event: Any) -> None:
            if isinstance(event, Logged):
                self.add(event)
            sink(event)
        return tapped

    def add(self, logged: Logged) -> None:
        with self._lock:
            for when, step, name, value in logged.points:
                series = self._series.setdefault((name, logged.rank), Thinned(MAX_POINTS))
                series.add((self._arrived, step, value, when))
                self._arrived += 1

    def take(self) -> dict[str, MetricSeries]:
        """The series so far, in the order they came; the next take starts empty (a
        session's next cell)."""
        with self._lock:
            taken, self._series = self._series, {}
        rows = sorted((arrived, name, rank, step, value, when)
                      for (name, rank), thinned in taken.items()
                      for arrived, step, value, when in thinned.items())
        result: dict[str, MetricSeries] = {}
        for _, name, rank, step, value, when in rows:
            series = result.setdefault(name, MetricSeries())
            series.steps.append(step)
            series.values.append(value)
            series.times.append(when)
            series.ranks.append(rank)
        return result


def as_frame(series: dict[str, MetricSeries]) -> Any:
    """A pandas DataFrame of every point: columns name, rank, step, value, time."""
    try:
        import pandas  # type: ignore[import-untyped]  # optional, untyped
    except ImportError:
        raise ImportError("metrics_frame() needs pandas (pip install pandas); "
                          "result.metrics holds the same points as plain lists") from None

    rows = [(name, rank, step, value, when) for name, s in series.items()
            for rank, step, value, when in zip(s.ranks, s.steps, s.values, s.times,
                                                 strict=True)]
    return pandas.DataFrame(rows, columns=["name", "rank", "step", "value", "time"])
