"""The static record a finished cell keeps: HTML and plain text, no JavaScript and no
widget state, so a saved notebook (or one run headless) still shows what happened.

The HTML follows the notebook's theme: colours are JupyterLab's CSS variables (with
fallbacks for other frontends), nothing sets a background, and it is one element per line,
so that an export to markdown (nbconvert) reads as well as it renders."""

from __future__ import annotations

import time
from html import escape
from typing import Any

from . import ansi
from .chart_svg import charts_svg
from .dashboard_state import DashboardState
from .describe import clock, count_of, duration

_STATE_COLORS = {"succeeded": "var(--jp-success-color1, #1a7f37)",
                 "failed": "var(--jp-error-color1, #cf222e)",
                 "stopped": "var(--jp-warn-color1, #9a6700)"}
_ERROR = "color: var(--jp-error-color1, #cf222e)"
_MUTED = "color: var(--jp-ui-font-color2, #57606a)"
_PRE = "max-height: 22em; overflow: auto; white-space: pre-wrap"


def _elapsed(header: dict[str, Any]) -> str:
    start, end = header.get("started_at"), header.get("finished_at") or time.time()
    return duration(end - start) if start else "-"


def summary_line(state: DashboardState) -> str:
    h = state.header
    text = (f"{h['state']} · world size {h['world_size']} · "
            f"{count_of(h['nnodes'], 'machine')} · restarts "
            f"{h['restarts']}/{h['max_restarts']} · round {h['round']} · {_elapsed(h)}")
    commit = h.get("last_commit")
    if commit:
        text += (f" · last commit: step {commit['step']} at world size "
                 f"{commit['world_size']}, {clock(commit['time'])}")
    return text


def record_text(state: DashboardState) -> str:
    lines = [f"[elastic] job {state.run_id}: {summary_line(state)}"]
    if state.header.get("join_command"):
        lines.append(f"other machines joined with: {state.header['join_command']}")
    if state.failure:
        f = state.failure
        label = f" ({f['attempt_label']})" if f.get("attempt_label") else ""
        lines.append(f"root cause: rank {f['rank']}: {f['headline']}{label}")
        lines += [f"  {line}" for line in f["traceback"].rstrip().splitlines()]
        lines += [f"  ranks {', '.join(map(str, o['ranks']))} also failed: {o['text']}"
                  for o in f["others"]]
        lines += [f"  rank {c['rank']}: {c['text']}" for c in f.get("consequences", ())]
    lines += _stacks_text(state)
    for name, (step, value, rank) in state.charts.latest.items():  # a nan said as nan
        lines.append(f"logged {name}: {value:.6g} at step {step} (rank {rank})")
    for earlier in state.earlier:
        lines.append(f"=== earlier group (restarts {earlier['restart']}): {earlier['why']} ===")
        for rank, rank_lines in earlier["lines"].items():
            lines += [f"[rank {rank}] {ansi.plain(text)}" for _, text in rank_lines]
    for rank, hidden in sorted(state.hidden().items()):
        shown = state.shown_lines(rank)
        more = f", {hidden} earlier lines in the log" if hidden else ""
        lines.append(f"--- rank {rank} (last {len(shown)} lines{more}) ---")
        lines += [f"[rank {rank}] {ansi.plain(text)}" for _, text in shown]
    lines.append("timeline:")
    lines += [f"  {clock(e['time'])} {e['text']}" for e in state.timeline]
    lines.append(f"logs: {state.log_dir}")
    return "\n".join(lines)


def _stacks_text(state: DashboardState) -> list[str]:
    if not state.stacks:
        return []
    lines = [f"{state.stacks['title']}:"]
    for rank, text in state.stacks["ranks"].items():
        lines.append(f"--- rank {rank} ---")
        lines += [f"  {line}" for line in text.splitlines()]
    return lines


def _text(text: str) -> str:
    """Escaped, its colours as styled spans (``ansi``), and never a blank line: in
    markdown a blank line would end the HTML."""
    return ansi.to_html(text) if ansi.plain(text).strip() else "&nbsp;"


def _pre(lines: list[tuple[str, str]]) -> str:
    body = "".join(f'<span style="{_ERROR}">{_text(text)}</span>\n' if stream == "stderr"
                   else f"{_text(text)}\n" for stream, text in lines)
    return f'<pre style="{_PRE}">{body}</pre>'


def _failure_html(f: dict[str, Any]) -> list[str]:
    parts = ['<div style="border-left: 3px solid var(--jp-error-color1, #cf222e); '
             'padding-left: 8px">',
             f'<b style="{_ERROR}">Root cause: rank {f["rank"]}</b> '
             f'({escape(f.get("attempt_label", ""))}): {escape(f["headline"])}',
             _pre([("", line) for line in f["traceback"].rstrip().splitlines()])]
    parts += [f"<div>Rank{'s' if len(o['ranks']) > 1 else ''} "
              f"{', '.join(map(str, o['ranks']))} also failed: {escape(o['text'])}</div>"
              for o in f["others"]]
    parts += [f'<div style="{_MUTED}">Rank {c["rank"]}: {escape(c["text"])}</div>'
              for c in f.get("consequences", ())]
    return [*parts, "</div>"]


def record_html(state: DashboardState) -> str:
    h = state.header
    color = _STATE_COLORS.get(h["state"], "inherit")
    parts = [
        '<div class="elastic-record">',
        f'<div><b>elastic job</b> <code>{escape(state.run_id)}</code> '
        f'<b class="elastic-record-state" style="color: {color}">{escape(h["state"])}</b> · '
        f'{escape(summary_line(state).split(" · ", 1)[1])}</div>',
    ]
    if h.get("join_command"):
        parts.append(f"<div>Other machines joined with: <code>{escape(h['join_command'])}"
                     "</code></div>")
    if state.failure:
        parts += _failure_html(state.failure)
    if svg := charts_svg(state.charts, state.timeline):
        parts += ["<details open><summary>Charts</summary>", svg, "</details>"]
    if state.stacks:
        parts.append(f"<details><summary>{escape(state.stacks['title']).capitalize()}"
                     "</summary>")
        for rank, text in state.stacks["ranks"].items():
            parts += [f"<div>Rank {escape(rank)}</div>",
                      _pre([("", line) for line in text.splitlines()])]
        parts.append("</details>")
    for earlier in state.earlier:  # every group's output stays reachable
        parts.append(f"<details><summary>Earlier group (restarts {earlier['restart']}): "
                     f"{escape(earlier['why'])}</summary>")
        for rank, lines in earlier["lines"].items():
            parts += [f"<div>Rank {rank}</div>", _pre(lines)]
        parts.append("</details>")
    hidden, logs = state.hidden(), state.log_paths()
    for rank in sorted(state.lines):
        more = f"{hidden[rank]} earlier lines not shown; " if hidden[rank] else ""
        parts += [f'<details open><summary>Rank {rank} <span style="{_MUTED}">({more}full '
                  f'log: {escape(logs[rank]["stdout"])})</span></summary>',
                  _pre(state.shown_lines(rank)), "</details>"]
    parts += ["<details><summary>Timeline</summary>", "<ul>"]
    parts += [f"<li>{clock(e['time'])} {escape(e['text'])}</li>" for e in state.timeline]
    parts += ["</ul>", "</details>", "</div>"]
    return "\n".join(parts)


def record_bundle(state: DashboardState) -> dict[str, str]:
    return {"text/plain": record_text(state), "text/html": record_html(state)}
