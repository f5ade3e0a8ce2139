"""The job's story as series, for its charts: the world size (and machines) over time, the
training's progress (steps per second between commits), and the scalars the cell logged
(``elastic_magic.log``). Kept from the same events as the rest of the dashboard; the marks on
the time axis (failures, restarts, resizes, machines, survivors) are its timeline's entries.
Bounded: a long job keeps its shape at less detail."""

from __future__ import annotations

import math
from typing import Any

from ..wire.events import (
    Committed,
    Event,
    MembershipChanged,
    RendezvousCompleted,
    Restarting,
    StateChanged,
)
from ..wire.metrics import Logged, Thinned

# Points kept of a series for the charts (the result keeps more): thousands draw at once,
# and more would only be wider than the chart.
CHART_POINTS = 2_000
# Timeline kinds marked on the time axis (``describe``'s words).
MARKED = {"failure": "failed", "restart": "restart", "resize": "resize",
          "membership": "resize", "nodes": "machines", "excluded": "excluded",
          "reformed": "re-formed", "start": "started", "failed": "failed"}


class Charts:
    """What the charts draw: ``sizes`` [(time, world size, machines)] as a step line (0 while
    a group is down), ``rates`` [(time, steps per second)] between commits, ``metrics``
    {name: [(step, value, rank)]}, each thinned evenly past ``CHART_POINTS``."""

    def __init__(self) -> None:
        self._sizes: Thinned[tuple[float, int, int]] = Thinned(CHART_POINTS)
        self._rates: Thinned[tuple[float, float]] = Thinned(CHART_POINTS)
        self._metrics: dict[tuple[str, int], Thinned[tuple[int, float]]] = {}  # name, rank
        self.latest: dict[str, tuple[int, float, int]] = {}  # nan and inf too: (step, v, rank)
        self._commit: tuple[float, int] | None = None  # the last commit: (time, step)

    def apply(self, event: Event) -> None:
        match event:
            case RendezvousCompleted(world_size=size, nnodes=machines):
                self._sizes.add((event.time, size, machines))
            case Restarting() | MembershipChanged() if self._sizes.latest:
                self._sizes.add((event.time, 0, 0))  # down until the next round forms
            case StateChanged(state=state) if state.is_final and self._sizes.latest:
                self._sizes.add((event.time, *self._sizes.latest[1:]))  # to the end
            case Committed(step=int(step)):
                last = self._commit
                if last is not None and event.time > last[0] and step >= last[1]:
                    self._rates.add((event.time, (step - last[1]) / (event.time - last[0])))
                self._commit = (event.time, step)
            case Logged(rank=rank, points=points):
                for _, step, name, value in points:
                    self.latest[name] = (step, value, rank)
                    if math.isfinite(value):  # a diverged loss's nan or inf: not drawable
                        self._metrics.setdefault((name, rank), Thinned(CHART_POINTS)).add(
                            (step, value))

    @property
    def sizes(self) -> list[tuple[float, int, int]]:
        return self._sizes.items()

    @property
    def rates(self) -> list[tuple[float, float]]:
        return self._rates.items()

    @property
    def metrics(self) -> dict[str, list[tuple[int, float, int]]]:
        """{name: [(step, value, rank)]}, rank by rank (each thinned on its own)."""
        drawn: dict[str, list[tuple[int, float, int]]] = {}
        for (name, rank), series in sorted(self._metrics.items()):
            drawn.setdefault(name, []).extend((s, v, rank) for s, v in series.items())
        return drawn

    @property
    def empty(self) -> bool:
        return len(self._sizes) < 2 and len(self._rates) < 2 and not self._metrics


def marks(timeline: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """The timeline's entries that belong on the time axis: (time, label, sentence)."""
    return [(e["time"], MARKED[e["kind"]], e["text"]) for e in timeline
            if e["kind"] in MARKED and (e["kind"] != "start" or "stayed" in e["text"])]
