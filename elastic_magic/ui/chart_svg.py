"""The charts of a finished cell's record as inline SVG: readable without JavaScript, in the
notebook's theme (text and axes in ``currentColor``, series in colours that read on light
and dark backgrounds), a sentence on hover (``<title>``) for every mark and series.

Panels, top to bottom, each drawn only when it has something to show: the world size
(each machine's ranks stacked under it, where there were several) over time with the
timeline's marks (failures, restarts, resizes, machines joining or leaving, survivors
staying); steps and samples per second between commits on the same time axis; each scalar
the cell logged, over its steps."""

from __future__ import annotations

from html import escape
from typing import Any

from .charts import MARK_COLORS, SERIES, Charts, marks
from .describe import clock

WIDTH, PANEL, LEFT, RIGHT, TOP, GAP = 640, 110, 48, 12, 18, 34
LEGEND_CHARS = 60  # what fits right of a panel's title at the record's font size


class _Panel:
    """One chart: its place, its axes' ranges, and what it maps a point to."""

    def __init__(self, top: float, x: tuple[float, float], y: tuple[float, float]) -> None:
        low, high = y[0], y[1] if y[1] > y[0] else y[0] + 1
        self.top, self.x, self.low, self.high = top, x, low, high
        self.y = (low, high + (high - low) * 0.08)  # the highest point below the frame's top

    def px(self, x: float) -> float:
        span = self.x[1] - self.x[0] or 1.0
        return LEFT + (x - self.x[0]) / span * (WIDTH - LEFT - RIGHT)

    def py(self, y: float) -> float:
        return self.top + PANEL - (y - self.y[0]) / (self.y[1] - self.y[0]) * PANEL

    def frame(self, title: str, x_labels: tuple[str, str], name: str) -> list[str]:
        bottom, right = self.top + PANEL, WIDTH - RIGHT
        return [f'<g class="elastic-chart" data-chart="{escape(name)}">',
                f'<text x="{LEFT}" y="{self.top - 5:.0f}" font-weight="bold">'
                f'{escape(title)}</text>',
                f'<path d="M{LEFT},{self.top} V{bottom} H{right}" fill="none" '
                'stroke="currentColor" stroke-opacity="0.5"/>',
                _text(LEFT - 4, self.py(self.high) + 4, _number(self.high), "end"),
                _text(LEFT - 4, bottom, _number(self.low), "end"),
                _text(LEFT, bottom + 13, x_labels[0], "start"),
                _text(right, bottom + 13, x_labels[1], "end")]


def _text(x: float, y: float, text: str, anchor: str) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" fill-opacity="0.75">'
            f'{escape(text)}</text>')


def _number(value: float) -> str:
    return f"{value:.4g}"


def _steps(panel: _Panel, points: list[tuple[float, float]]) -> str:
    """A step line: each value holds until the next point."""
    d = f"M{panel.px(points[0][0]):.1f},{panel.py(points[0][1]):.1f}"
    for x, y in points[1:]:
        d += f" H{panel.px(x):.1f} V{panel.py(y):.1f}"
    return d


def _steps_back(panel: _Panel, points: list[tuple[float, float]]) -> str:
    """The same step line from its end to its start: a band's lower edge."""
    (x, y), earlier = points[-1], points[-2::-1]
    return f"L{panel.px(x):.1f},{panel.py(y):.1f}" + "".join(
        f" V{panel.py(y):.1f} H{panel.px(x):.1f}" for x, y in earlier)


def _line(panel: _Panel, points: list[tuple[float, float]]) -> str:
    return " ".join(f"{panel.px(x):.1f},{panel.py(y):.1f}" for x, y in points)


def _machine_bands(panel: _Panel, names: list[str], split: list[tuple[float, list[int]]]
                   ) -> list[str]:
    """Each machine's ranks as a band, stacked up to the world size (the live charts' look);
    nothing for a job of one machine."""
    if not names:
        return []
    parts = []
    below = [(t, 0.0) for t, _ in split]
    for i, name in enumerate(names):
        above = [(t, low + ranks[i]) for (t, ranks), (_, low) in zip(split, below, strict=True)]
        color = _machine_color(i)
        parts.append(f'<path class="elastic-machine" d="{_steps(panel, above)} '
                     f'{_steps_back(panel, below)} Z" '
                     f'fill="{color}" fill-opacity="0.35" stroke="{color}" stroke-width="1">'
                     f'<title>{escape(name)}: {split[-1][1][i]} ranks at the end</title></path>')
        below = above
    return [*parts, _legend(panel, names)]


def _machine_color(index: int) -> str:
    """The palette past the world size's and the rates' colours (live_charts.js does the same)."""
    return SERIES[2 + index % (len(SERIES) - 2)]


def _legend(panel: _Panel, names: list[str]) -> str:
    """The bands' colours and machines, right of the panel's title, as many as fit in a
    line (the rest said as a count: each band names its machine on hover)."""
    shown, room = [], LEGEND_CHARS
    for i, name in enumerate(names):
        if len(name) + 3 > room - (len("  and 99 more") if i < len(names) - 1 else 0):
            shown.append(f"and {len(names) - i} more")
            break
        room -= len(name) + 3
        shown.append(f'<tspan fill="{_machine_color(i)}">■</tspan> '
                     f"{escape(name)}")
    return (f'<text class="elastic-legend" x="{WIDTH - RIGHT}" y="{panel.top - 5:.0f}" '
            f'text-anchor="end" xml:space="preserve">{"  ".join(shown)}</text>')


def _time_panels(charts: Charts, timeline: list[dict[str, Any]], top: float
                 ) -> tuple[list[str], float]:
    """The panels over time, if any has two points, and where the next panel goes."""
    sizes = charts.sizes
    progress = [(charts.rates, "steps/s", "steps_per_second", SERIES[1]),
                (charts.samples, "samples/s", "samples_per_second", SERIES[3])]
    times = [t for t, _, _ in sizes] + [t for rates, *_ in progress for t, _ in rates]
    parts: list[str] = []
    if len(sizes) < 2 and all(len(rates) < 2 for rates, *_ in progress):
        return parts, top
    span = (min(times), max(times))
    labels = (clock(span[0]), clock(span[1]))
    if len(sizes) >= 2:
        panel = _Panel(top, span, (0, max(size for _, size, _ in sizes)))
        parts += panel.frame("world size", labels, "world_size")
        names, split = charts.by_machine
        parts += _machine_bands(panel, names, split)  # under the world size's line
        line = [(t, float(size)) for t, size, _ in sizes]
        parts.append(f'<path d="{_steps(panel, line)}" fill="none" stroke="{SERIES[0]}" '
                     f'stroke-width="2"><title>world size: {sizes[-1][1]} at the '
                     'end</title></path>')
        if not names and max(machines for _, _, machines in sizes) > 1:
            machines = [(t, float(m)) for t, _, m in sizes]
            parts.append(f'<path d="{_steps(panel, machines)}" fill="none" '
                         f'stroke="{SERIES[2]}" stroke-dasharray="4 3"><title>machines'
                         '</title></path>')
        for when, label, sentence in marks(timeline):
            if span[0] <= when <= span[1]:
                x, color = panel.px(when), MARK_COLORS.get(label, "currentColor")
                said = sentence if len(sentence) <= 200 else sentence[:199] + "…"
                parts += [f'<g class="elastic-mark" data-kind="{escape(label)}">',
                          f"<title>{clock(when)} {escape(said)}</title>",
                          f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" '
                          f'y2="{top + PANEL:.1f}" stroke="{color}" stroke-dasharray="3 2"/>',
                          f'<circle cx="{x:.1f}" cy="{top + 4:.1f}" r="3.5" fill="{color}"/>',
                          "</g>"]
        parts.append("</g>")
        top += PANEL + GAP
    for rates, unit, name, color in progress:
        if len(rates) < 2:
            continue
        panel = _Panel(top, span, (0, max(rate for _, rate in rates)))
        parts += panel.frame(f"{unit} between commits", labels, name)
        parts.append(f'<polyline points="{_line(panel, rates)}" fill="none" '
                     f'stroke="{color}" stroke-width="1.5"><title>{unit}: '
                     f'{_number(rates[-1][1])} at the end</title></polyline></g>')
        top += PANEL + GAP
    return parts, top


def _metric_panel(name: str, points: list[tuple[int, float, int]], top: float) -> list[str]:
    steps = [step for step, _, _ in points]
    values = [value for _, value, _ in points]
    panel = _Panel(top, (min(steps), max(steps)), (min(values), max(values)))
    parts = panel.frame(name, (f"step {min(steps)}", f"step {max(steps)}"), name)
    ranks = sorted({rank for _, _, rank in points})
    for i, rank in enumerate(ranks):
        mine = [(float(s), v) for s, v, r in points if r == rank]
        who = f" (rank {rank})" if len(ranks) > 1 else ""
        parts.append(f'<polyline points="{_line(panel, mine)}" fill="none" '
                     f'stroke="{SERIES[i % len(SERIES)]}" stroke-width="1.5"><title>'
                     f'{escape(name)}{who}: {_number(mine[-1][1])} at step '
                     f'{mine[-1][0]:.0f}</title></polyline>')
    return [*parts, "</g>"]


def charts_svg(charts: Charts, timeline: list[dict[str, Any]]) -> str:
    """The record's charts, or "" when there is nothing to draw."""
    if charts.empty:
        return ""
    parts, top = _time_panels(charts, timeline, float(TOP))
    for name, points in charts.metrics.items():
        parts += _metric_panel(name, points, top)
        top += PANEL + GAP
    height = top - GAP + 20
    # One element a line, as the rest of the record (a markdown export keeps it one block)
    return "\n".join([f'<svg class="elastic-charts" xmlns="http://www.w3.org/2000/svg" '
                      f'viewBox="0 0 {WIDTH} {height:.0f}" width="{WIDTH}" '
                      f'height="{height:.0f}" font-family="sans-serif" font-size="11" '
                      'fill="currentColor" role="img">', *parts, "</svg>"])
