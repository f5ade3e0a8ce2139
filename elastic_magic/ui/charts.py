"""The job's story as series, for its charts: the world size (and machines) over time, the
training's progress (steps per second between commits), and the scalars the cell logged
(``elastic_magic.log``). Kept from the same events as the rest of the dashboard; the marks on
the time axis (failures, restarts, resizes, machines, survivors) are its timeline's entries.
Bounded: a long job keeps its shape at less detail."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..wire.events import (
    Committed,
    Event,
    MembershipChanged,
    RendezvousCompleted,
    Restarting,
    StateChanged,
)
from ..wire.metrics import Logged

# Points kept of a series for the charts (the result keeps more): past it, every other one
# is dropped. Thousands draw at once; more would only be wider than the chart.
CHART_POINTS = 2_000
# Timeline kinds marked on the time axis (``describe``'s words).
MARKED = {"failure": "failed", "restart": "restart", "resize": "resize",
          "membership": "resize", "nodes": "machines", "excluded": "excluded",
          "reformed": "re-formed", "start": "started", "failed": "failed"}


def _add(points: list[Any], point: Any) -> None:
    points.append(point)
    if len(points) > CHART_POINTS:
        del points[1:-1:2]  # the first and the latest stay


@dataclass
class Charts:
    """What the charts draw: ``sizes`` [(time, world size, machines)] as a step line (0 while
    a group is down), ``rates`` [(time, steps per second)] between commits, ``metrics``
    {name: [(step, value, rank)]}."""

    sizes: list[tuple[float, int, int]] = field(default_factory=list)
    rates: list[tuple[float, float]] = field(default_factory=list)
    metrics: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    _commit: tuple[float, int] | None = None  # the last commit: (time, step)

    def apply(self, event: Event) -> None:
        match event:
            case RendezvousCompleted(world_size=size, nnodes=machines):
                _add(self.sizes, (event.time, size, machines))
            case Restarting() | MembershipChanged() if self.sizes:
                _add(self.sizes, (event.time, 0, 0))  # down until the next round forms
            case StateChanged(state=state) if state.is_final and self.sizes:
                _add(self.sizes, (event.time, *self.sizes[-1][1:]))  # to the end
            case Committed(step=int(step)):
                last = self._commit
                if last is not None and event.time > last[0] and step >= last[1]:
                    _add(self.rates, (event.time, (step - last[1]) / (event.time - last[0])))
                self._commit = (event.time, step)
            case Logged(rank=rank, points=points):
                for _, step, name, value in points:
                    _add(self.metrics.setdefault(name, []), (step, value, rank))

    @property
    def empty(self) -> bool:
        return len(self.sizes) < 2 and not self.metrics and not self.rates


def marks(timeline: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """The timeline's entries that belong on the time axis: (time, label, sentence)."""
    return [(e["time"], MARKED[e["kind"]], e["text"]) for e in timeline
            if e["kind"] in MARKED and (e["kind"] != "start" or "stayed" in e["text"])]
