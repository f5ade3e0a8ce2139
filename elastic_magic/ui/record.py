"""The static record a finished cell keeps: HTML and plain text, no JavaScript and no
widget state, so a saved notebook (or one run headless) still shows what happened."""

from __future__ import annotations

import time
from html import escape
from typing import Any

from .state import DashboardState

_COLORS = {"succeeded": "#1a7f37", "failed": "#cf222e", "stopped": "#9a6700"}
_BOX = "border:1px solid #d0d7de;border-radius:6px;padding:8px 10px;margin:6px 0;"
_PRE = ("margin:4px 0 0;max-height:22em;overflow:auto;font-size:12px;line-height:1.35;"
        "white-space:pre-wrap;")


def _elapsed(header: dict[str, Any]) -> str:
    start, end = header.get("started_at"), header.get("finished_at") or time.time()
    return f"{end - start:.1f}s" if start else "-"


def summary_line(state: DashboardState) -> str:
    h = state.header
    nodes = f"{h['nnodes']} node{'s' if h['nnodes'] != 1 else ''}"
    text = (f"{h['state']} · world size {h['world_size']} · {nodes} · restarts "
            f"{h['restarts']}/{h['max_restarts']} · round {h['round']} · {_elapsed(h)}")
    commit = h.get("last_commit")
    if commit:
        text += (f" · last commit: step {commit['step']} at world size "
                 f"{commit['world_size']}, {_clock(commit['time'])}")
    return text


def record_text(state: DashboardState) -> str:
    lines = [f"[elastic] job {state.run_id}: {summary_line(state)}"]
    if state.failure:
        f = state.failure
        lines.append(f"root cause: rank {f['rank']}: {f['headline']}")
        lines += [f"  {line}" for line in f["traceback"].rstrip().splitlines()]
        lines += [f"  ranks {', '.join(map(str, o['ranks']))} also failed: {o['text']}"
                  for o in f["others"]]
        lines += [f"  rank {c['rank']}: {c['text']}" for c in f.get("consequences", ())]
    lines += _stacks_text(state)
    for rank, hidden in sorted(state.hidden().items()):
        more = f", {hidden} earlier lines in the log" if hidden else ""
        lines.append(f"--- rank {rank} (last {len(state.lines[rank])} lines{more}) ---")
        lines += [f"[rank {rank}] {text}" for _, text in state.lines[rank]]
    lines.append("timeline:")
    lines += [f"  {_clock(e['time'])} {e['text']}" for e in state.timeline]
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


def _stacks_html(state: DashboardState) -> str:
    if not state.stacks:
        return ""
    ranks = "".join(f'<div>Rank {escape(rank)}</div><pre style="{_PRE}">{escape(text)}</pre>'
                    for rank, text in state.stacks["ranks"].items())
    return (f'<details style="{_BOX}"><summary>{escape(state.stacks["title"]).capitalize()}'
            f"</summary>{ranks}</details>")


def _clock(when: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when))


def record_html(state: DashboardState) -> str:
    h = state.header
    color = _COLORS.get(h["state"], "#57606a")
    parts = [
        '<div class="elastic-record" style="font-family:system-ui,sans-serif;font-size:13px">',
        f'<div style="{_BOX}"><b>elastic job</b> <code>{escape(state.run_id)}</code> '
        f'<span style="background:{color};color:white;border-radius:10px;padding:1px 8px">'
        f'{escape(h["state"])}</span> {escape(summary_line(state).split(" · ", 1)[1])}</div>',
    ]
    if state.failure:
        f = state.failure
        others = "".join(
            f"<div>Rank{'s' if len(o['ranks']) > 1 else ''} {', '.join(map(str, o['ranks']))} "
            f"also failed: {escape(o['text'])}</div>" for o in f["others"])
        others += "".join(f"<div>Rank {c['rank']}: {escape(c['text'])}</div>"
                          for c in f.get("consequences", ()))
        parts.append(
            f'<div style="{_BOX}border-color:#cf222e;background:#fff5f5">'
            f'<b>Root cause: rank {f["rank"]}</b> (attempt {f["attempt"]}): '
            f'{escape(f["headline"])}<pre style="{_PRE}">{escape(f["traceback"])}</pre>'
            f"{others}</div>")
    parts.append(_stacks_html(state))
    hidden, logs = state.hidden(), state.log_paths()
    for rank in sorted(state.lines):
        body = "".join(
            f'<span style="color:#cf222e">{escape(text)}</span>\n' if stream == "stderr"
            else f"{escape(text)}\n" for stream, text in state.lines[rank])
        more = f"{hidden[rank]} earlier lines not shown; " if hidden[rank] else ""
        parts.append(
            f'<details open style="{_BOX}"><summary>Rank {rank} '
            f'<span style="color:#57606a">({more}full log: {escape(logs[rank]["stdout"])})'
            f'</span></summary><pre style="{_PRE}">{body}</pre></details>')
    events = "".join(f"<li>{_clock(e['time'])} {escape(e['text'])}</li>"
                     for e in state.timeline)
    parts.append(f'<details style="{_BOX}"><summary>Timeline</summary><ul>{events}</ul>'
                 "</details></div>")
    return "".join(parts)


def record_bundle(state: DashboardState) -> dict[str, str]:
    return {"text/plain": record_text(state), "text/html": record_html(state)}
