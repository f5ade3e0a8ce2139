"""What a dashboard shows, derived from agent events; no widget code here, so the live
widget and the static record share one source of truth."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..logs import rank_dir
from ..result import (
    JobResult,
    JobState,
    RankFailure,
    after,
    group_failures,
    short_message,
    split_consequences,
)
from ..wire.events import (
    AcceptingNodes,
    CellStarted,
    Committed,
    Event,
    Excluded,
    JobFinished,
    MembershipChanged,
    NodeConnected,
    Output,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    StateChanged,
    WorkersStarted,
)
from . import ansi
from .charts import Charts
from .describe import count_of, describe

RANK_LINES = 150  # per rank, in the browser; the full output is in the logs
MERGED_LINES = 300
EARLIER_ATTEMPTS = 5  # earlier groups (restarts, resizes) whose tails stay in the browser
TRACEBACK_SHOWN = "(its traceback is in the root cause above)"


@dataclass
class DashboardState:
    """Everything a job's dashboard shows, kept up to date from its events: what the live
    widget syncs and the static record the cell keeps are both drawn from it."""

    run_id: str
    log_dir: str
    max_restarts: int
    header: dict[str, Any] = field(default_factory=dict)
    lines: dict[int, deque[tuple[str, str]]] = field(default_factory=dict)
    merged: deque[tuple[int, str, str]] = field(default_factory=lambda: deque(maxlen=MERGED_LINES))
    counts: dict[int, int] = field(default_factory=dict)  # lines seen per rank, this attempt
    local_ranks: set[int] = field(default_factory=set)  # the others run on other machines
    attempt: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, Any] = field(default_factory=dict)
    # Every rank's stacks: asked for with the Stacks button, or kept by a job that failed
    # by a timeout or a stall. {"title": ..., "ranks": {"0": text}}
    stacks: dict[str, Any] = field(default_factory=dict)
    result: JobResult | None = None
    # Earlier groups of this job (before a restart or a resize), newest last: their tails,
    # and why they ended. {"attempt", "restart", "why", "lines": {rank: [(stream, text)]}}
    earlier: list[dict[str, Any]] = field(default_factory=list)
    _ended_by: str = "ended"  # why the current group will end, once known
    # Lines being rewritten with carriage returns (progress bars), as they show now: one
    # per rank and stream, after that rank's lines; replaced as they change.
    partial: dict[tuple[int, str], str] = field(default_factory=dict)
    charts: Charts = field(default_factory=Charts)  # sizes, progress and logged scalars

    def __post_init__(self) -> None:
        self.header = {
            "run_id": self.run_id, "state": JobState.RENDEZVOUS.value, "world_size": 0,
            "nnodes": 0, "round": 0, "restarts": 0, "max_restarts": self.max_restarts,
            "started_at": None, "finished_at": None, "log_dir": self.log_dir,
            "pending_resize": None, "last_commit": None, "nproc": 0, "join_command": None,
        }

    @property
    def final(self) -> bool:
        return JobState(self.header["state"]).is_final

    def apply(self, event: Event) -> None:
        self._update(event)
        self.charts.apply(event)
        note = describe(event)
        if note is not None:  # in time order: another machine's word may come in late
            bisect.insort(self.timeline, {"time": event.time, "kind": note.kind,
                                          "text": note.text}, key=lambda e: e["time"])

    def _update(self, event: Event) -> None:
        """The header and the lines; the timeline's sentences come from ``describe``."""
        match event:
            case Output():
                self._output(event)
            case StateChanged():
                self.header["state"] = event.state.value
                if self.header["started_at"] is None:
                    self.header["started_at"] = event.time
                if event.state.is_final:
                    self.header["finished_at"] = event.time
            case RendezvousCompleted():
                self.header.update(world_size=event.world_size, nnodes=event.nnodes,
                                   round=event.round)
            case WorkersStarted():
                self._new_attempt(event.attempt, event.ranks)
                self.header["restarts"] = event.restart_count
            case CellStarted():  # a session's cell, on the group formed before it
                if event.attempt != self.attempt or not self.local_ranks:
                    self._new_attempt(event.attempt, event.ranks)
                self.header.update(world_size=event.world_size, nnodes=event.nnodes,
                                   round=event.round, restarts=event.restart_count,
                                   started_at=event.began, finished_at=None)
            case Committed():
                self.header["last_commit"] = {"step": event.step, "time": event.time,
                                              "world_size": event.world_size,
                                              "nbytes": event.nbytes}
            case ResizeRequested():
                self.header["pending_resize"] = event.target
            case MembershipChanged():
                self.header["pending_resize"] = None
                self._ended_by = (f"ended by a resize ({event.old_nproc} -> "
                                  f"{count_of(event.new_nproc, 'worker')} here)")
            case Restarting():
                cause = event.root_cause
                self._ended_by = (f"ended by a failure: rank {cause.rank}: {cause.headline} "
                                  f"(restart {event.restart_count}/{event.max_restarts} "
                                  "followed)")
            # A machine's arrival or departure re-forms every machine's group, unless a
            # failure or a resize already ended it (their reason stands).
            case NodeConnected(peer=peer, connected=True) if self._ended_by == "ended":
                self._ended_by = f"ended by machine {peer} joining the job"
            case NodeConnected(peer=peer, connected=False, reason=reason) \
                    if self._ended_by == "ended":
                self._ended_by = f"ended by machine {peer} leaving" + (f": {reason}" if reason
                                                                       else "")
            case Excluded(what=what, why=why) if self._ended_by == "ended":
                self._ended_by = f"ended by {what} being excluded: {why}"
            case AcceptingNodes():
                self.header["join_command"] = event.command
            case JobFinished():
                result = self.result = event.result
                self.header["state"] = result.state.value  # a session's cell ends idle
                self.header["restarts"] = result.restarts
                self.header["pending_resize"] = None
                if result.started:  # the clock says what the result's duration says
                    self.header.update(started_at=result.started,
                                       finished_at=result.started + result.duration)
                if result.failure is not None:
                    self.failure = failure_view(result.failure, result.failures)
                    self.failure["attempt_label"] = (f"attempt {result.restarts + 1} of "
                                                     f"{result.max_restarts + 1}")
                if result.stacks:
                    self.show_stacks(result.stacks, "stacks of the stuck ranks, kept when "
                                                    "the job failed", event.time)

    def _new_attempt(self, attempt: int, ranks: tuple[int, ...]) -> None:
        self._keep_earlier()
        self.attempt = attempt
        self.header["nproc"] = len(ranks)  # this machine's, of the world size
        self.lines = {rank: deque(maxlen=RANK_LINES) for rank in ranks}
        self.local_ranks = set(ranks)
        self.merged.clear()
        self.partial.clear()
        self.counts = dict.fromkeys(ranks, 0)

    def _output(self, event: Output) -> None:
        if event.attempt != self.attempt:
            return
        if event.rank not in self.lines:  # a rank on another machine of a multi-node job
            self.lines[event.rank] = deque(maxlen=RANK_LINES)
            self.counts[event.rank] = 0
        key = (event.rank, event.stream)
        self.partial.pop(key, None)  # this event's first line replaces it
        lines = event.lines[:-1] if event.partial else event.lines
        if event.partial:
            self.partial[key] = event.lines[-1]
        for line in lines:
            self.lines[event.rank].append((event.stream, line))
            self.merged.append((event.rank, event.stream, line))
        self.counts[event.rank] += len(lines)

    def _keep_earlier(self) -> None:
        """A new group starts: the one before keeps its tails, and why it ended."""
        if any(self.lines.values()):
            self.earlier.append({
                "attempt": self.attempt, "restart": self.header["restarts"],
                "why": self._ended_by,
                "lines": {r: list(lines) for r, lines in sorted(self.lines.items())},
                "hidden": self.hidden(),
            })
            del self.earlier[:-EARLIER_ATTEMPTS]
        self._ended_by = "ended"

    def shown_lines(self, rank: int) -> list[tuple[str, str]]:
        """A rank's tail as shown: the root cause's traceback, which the failure box shows,
        is not repeated under its rank."""
        lines = list(self.lines.get(rank, ()))
        if self.failure.get("rank") != rank or not self.failure.get("traceback"):
            return lines
        trace = ansi.plain(self.failure["traceback"]).rstrip("\n").splitlines()
        texts = [ansi.plain(text) for _, text in lines]
        for start in range(len(texts) - len(trace), -1, -1):
            if texts[start:start + len(trace)] == trace:
                return [*lines[:start], ("stderr", TRACEBACK_SHOWN),
                        *lines[start + len(trace):]]
        return lines

    def show_stacks(self, stacks: dict[int, str], title: str, when: float) -> None:
        self.stacks = {"title": title, "time": when,
                       "ranks": {str(r): text for r, text in sorted(stacks.items())}}

    def hidden(self) -> dict[int, int]:
        """Lines of this attempt no longer in the browser, per rank (they are in the logs)."""
        return {r: self.counts[r] - len(self.lines[r]) for r in self.lines}

    def log_paths(self) -> dict[int, dict[str, str]]:
        elsewhere = "on the machine that runs this rank (elastic-magic join --log-dir)"
        return {r: {s: str(rank_dir(Path(self.log_dir), self.attempt, r) / f"{s}.log")
                    if r in self.local_ranks else elsewhere for s in ("stdout", "stderr")}
                for r in self.lines}

    def traits(self, *, charts: bool = True) -> dict[str, Any]:
        """The widget's synced state (JSON-friendly; rank keys as strings); ``charts``:
        with the charts' series (the largest part, sent less often)."""
        drawn = {"charts": self.charts.live(self.timeline, final=self.final)} if charts else {}
        return {**drawn,
            "header": dict(self.header),
            "ranks": sorted(self.lines),
            "lines": {str(r): [shown(s, text=t) for s, t in self.shown_lines(r)]
                      + [shown(stream, text=text) for (rank, stream), text
                         in self.partial.items() if rank == r] for r in self.lines},
            "merged": [shown(r, s, text=t) for r, s, t in self.merged]
                      + [shown(r, s, text=t) for (r, s), t in sorted(self.partial.items())],
            "hidden": {str(r): n for r, n in self.hidden().items()},
            "logs": {str(r): p for r, p in self.log_paths().items()},
            "timeline": list(self.timeline),
            "failure": dict(self.failure),
            "stacks": dict(self.stacks),
            "earlier": [{**e, "lines": {str(r): [shown(s, text=t) for s, t in lines]
                                        for r, lines in e["lines"].items()},
                         "hidden": {str(r): n for r, n in e["hidden"].items()}}
                        for e in self.earlier],
        }


def shown(*head: Any, text: str) -> list[Any]:
    """A line as the widget gets it: ``[*head, text]`` with the text's escape sequences
    gone, and where it had any, its styled runs after it (``[[css, text], ...]``, from
    ``ansi``: the script renders them as given, with no parser of its own)."""
    if "\x1b" not in text:
        return [*head, text]
    return [*head, ansi.plain(text), [list(span) for span in ansi.spans(text)]]


def failure_view(root: RankFailure, failures: list[RankFailure]) -> dict[str, Any]:
    independent, consequences = split_consequences(root, failures)
    others = []
    for failure, ranks in group_failures(independent):
        same = failure.signature == root.signature
        others.append({"ranks": ranks, "text": "the same error" if same
                       else ansi.plain(failure.headline)})
    return {
        "rank": root.rank, "headline": ansi.plain(root.headline),
        "traceback": ansi.plain(root.traceback),
        "cell_line": root.cell_line, "source_line": root.source_line,
        "attempt": root.attempt, "others": others,
        # ranks that failed or waited because of the root cause: one line each
        "consequences": [{"rank": f.rank, "text": f"{short_message(f)} ({after(root)})"}
                         for f in consequences],
    }
