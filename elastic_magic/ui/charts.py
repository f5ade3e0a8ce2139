"""The job's story as series, for its charts: the world size (and machines) over time, the
training's progress (steps and samples per second between commits), and the scalars the cell logged
(``elastic_magic.log``). Kept from the same events as the rest of the dashboard; the marks on
the time axis (failures, restarts, resizes, machines, survivors) are its timeline's entries.
Bounded: a long job keeps its shape at less detail."""

from __future__ import annotations

import math
import threading
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

Machines = tuple[tuple[str, int], ...]  # each machine's (name, ranks) in a group

# Points kept of a series for the charts (the result keeps more): thousands draw at once,
# and more would only be wider than the chart.
CHART_POINTS = 2_000
# Points of a series the live charts get (resent whole at most once a second): a chart is
# a few hundred pixels wide.
LIVE_POINTS = 400
# Timeline kinds marked on the time axis (``describe``'s words).
MARKED = {"failure": "failed", "restart": "restart", "resize": "resize",
          "membership": "resize", "nodes": "machines", "excluded": "excluded",
          "reformed": "re-formed", "start": "started", "failed": "failed"}
# The one palette of the record's SVG and the live charts: colours that read on light and
# dark backgrounds alike.
SERIES = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#e377c2", "#17becf")
MARK_COLORS = {"failed": "#d62728", "restart": "#d62728", "resize": "#9467bd",
               "machines": "#2ca02c", "excluded": "#8c564b", "re-formed": "#ff7f0e",
               "started": "#ff7f0e"}


class Charts:
    """What the charts draw: ``sizes`` [(time, world size, machines)] as a step line (0 while
    a group is down), ``by_machine`` the same split per machine where there were several,
    ``rates`` [(time, steps per second)] between commits (``samples``: the
    same in samples, where the State holds an ElasticSampler), ``metrics``
    {name: [(step, value, rank)]}, each thinned evenly past ``CHART_POINTS``. Fed on the
    view's thread, read by the panel's too (``live``): a lock keeps the two apart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (time, world size, machines, each machine's (name, ranks))
        self._sizes: Thinned[tuple[float, int, int, Machines]] = Thinned(CHART_POINTS)
        self._rates: Thinned[tuple[float, float]] = Thinned(CHART_POINTS)
        self._samples: Thinned[tuple[float, float]] = Thinned(CHART_POINTS)
        self._metrics: dict[tuple[str, int], Thinned[tuple[int, float]]] = {}  # name, rank
        self.latest: dict[str, tuple[int, float, int]] = {}  # nan and inf too: (step, v, rank)
        # the last commit: (time, step, samples so far or None)
        self._commit: tuple[float, int, int | None] | None = None

    def apply(self, event: Event) -> None:
        with self._lock:
            self._apply(event)

    def _apply(self, event: Event) -> None:
        match event:
            case RendezvousCompleted(world_size=size, nnodes=count, machines=machines):
                self._sizes.add((event.time, size, count, machines))
            case Restarting() | MembershipChanged() if self._sizes.latest:
                self._sizes.add((event.time, 0, 0, ()))  # down until the next round forms
            case StateChanged(state=state) if state.is_final and self._sizes.latest:
                self._sizes.add((event.time, *self._sizes.latest[1:]))  # to the end
            case Committed(step=int(step), samples=samples):
                last = self._commit
                if last is not None and event.time > last[0] and step >= last[1]:
                    took = event.time - last[0]
                    self._rates.add((event.time, (step - last[1]) / took))
                    if samples is not None and last[2] is not None and samples >= last[2]:
                        self._samples.add((event.time, (samples - last[2]) / took))
                self._commit = (event.time, step, samples)
            case Logged(rank=rank, points=points):
                for _, step, name, value in points:
                    self.latest[name] = (step, value, rank)
                    if math.isfinite(value):  # a diverged loss's nan or inf: not drawable
                        self._metrics.setdefault((name, rank), Thinned(CHART_POINTS)).add(
                            (step, value))

    @property
    def sizes(self) -> list[tuple[float, int, int]]:
        return [(t, size, count) for t, size, count, _ in self._sizes.items()]

    @property
    def by_machine(self) -> tuple[list[str], list[tuple[float, list[int]]]]:
        """The world size split per machine: their names (in the order they came), and at
        each time every machine's ranks (0: not in that group). No names for a job that
        never had two machines."""
        sizes = self._sizes.items()
        names = list(dict.fromkeys(name for *_, machines in sizes for name, _ in machines))
        if len(names) < 2:
            return [], []
        rows = []
        for t, _, _, machines in sizes:
            ranks = dict(machines)
            rows.append((t, [ranks.get(name, 0) for name in names]))
        return names, rows

    @property
    def rates(self) -> list[tuple[float, float]]:
        return self._rates.items()

    @property
    def samples(self) -> list[tuple[float, float]]:
        """Samples per second between commits, where the State holds an ElasticSampler."""
        return self._samples.items()

    @property
    def metrics(self) -> dict[str, list[tuple[int, float, int]]]:
        """{name: [(step, value, rank)]}, rank by rank (each thinned on its own)."""
        drawn: dict[str, list[tuple[int, float, int]]] = {}
        for (name, rank), series in sorted(self._metrics.items()):
            drawn.setdefault(name, []).extend((s, v, rank) for s, v in series.items())
        return drawn

    @property
    def empty(self) -> bool:
        return (len(self._sizes) < 2 and len(self._rates) < 2 and len(self._samples) < 2
                and not self._metrics)

    def live(self, timeline: list[dict[str, Any]], *, final: bool, metrics: bool = True,
             points: int = LIVE_POINTS) -> dict[str, Any]:
        """What the live charts draw (``live_charts.js``), JSON-friendly and small: each
        series at most ``points`` long, times to the hundredth of a second, values to six
        digits. ``final``: the job has ended (a running one's lines reach the present)."""
        with self._lock:
            sizes, rates, samples = self.sizes, self.rates, self.samples
            names, split = self.by_machine
            logged: dict[str, list[list[Any]]] = {}
            for (name, rank), series in sorted(self._metrics.items()) if metrics else ():
                logged.setdefault(name, []).extend(
                    [step, _short(value), rank] for step, value in evenly(series.items(), points))
        return {
            "final": final,
            "sizes": [[round(t, 2), size, machines] for t, size, machines
                      in evenly(sizes, points)],
            # [[time, ranks of machine 0, of machine 1, ...]], where there were several
            "machines": names,
            "by_machine": [[round(t, 2), *ranks] for t, ranks in evenly(split, points)],
            "rates": [[round(t, 2), _short(rate)] for t, rate in evenly(rates, points)],
            "samples": [[round(t, 2), _short(rate)] for t, rate in evenly(samples, points)],
            "marks": [[round(t, 2), label, sentence] for t, label, sentence in marks(timeline)],
            "metrics": logged,  # {name: [[step, value, rank], ...]}, rank by rank
            "colors": {"series": list(SERIES), "marks": MARK_COLORS},
        }


def evenly(items: list[Any], most: int) -> list[Any]:
    """At most ``most`` of ``items``, spread evenly, the first and the last among them."""
    if len(items) <= most:
        return items
    stride = (len(items) - 1) / (most - 1)
    return [items[round(i * stride)] for i in range(most)]


def _short(value: float) -> float:
    return float(f"{value:.6g}")


def marks(timeline: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """The timeline's entries that belong on the time axis: (time, label, sentence)."""
    return [(e["time"], MARKED[e["kind"]], e["text"]) for e in timeline
            if e["kind"] in MARKED and (e["kind"] != "start" or "stayed" in e["text"])]
