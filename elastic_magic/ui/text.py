"""Plain-text renderer: each rank's lines with a ``[rank N]`` prefix, plus status lines."""

from __future__ import annotations

import sys
from typing import TextIO

from ..events import (
    AcceptingNodes,
    Committed,
    Event,
    JobFinished,
    MembershipChanged,
    NodeConnected,
    Output,
    RendezvousCompleted,
    ResizeRequested,
    Restarting,
    WorkerFailed,
    WorkersStarted,
)


class TextRenderer:
    """Writes batches of events to stdout/stderr (resolved at write time: IPython swaps
    ``sys.stdout`` per cell), one write per stream run, in event order."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 status: bool = True) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self.status = status

    def __call__(self, events: list[Event]) -> None:
        runs: list[tuple[str, list[str]]] = []  # (stream, lines), merged while stream repeats
        for event in events:
            for stream, lines in self._lines(event):
                if runs and runs[-1][0] == stream:
                    runs[-1][1].extend(lines)
                else:
                    runs.append((stream, list(lines)))
        for stream, lines in runs:
            out = self._stream(stream)
            out.write("\n".join(lines) + "\n")
            out.flush()

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._stderr or sys.stderr
        return self._stdout or sys.stdout

    def _lines(self, event: Event) -> list[tuple[str, list[str]]]:
        if isinstance(event, Output):
            prefix = f"[rank {event.rank}] "
            return [(event.stream, [prefix + line for line in event.lines])]
        if not self.status:
            return []
        if isinstance(event, RendezvousCompleted):
            nodes = "1 node" if event.nnodes == 1 else f"{event.nnodes} nodes"
            text = f"rendezvous round {event.round}: world size {event.world_size} on {nodes}"
        elif isinstance(event, WorkersStarted) and event.restart_count:
            text = f"restart {event.restart_count}: started ranks {_ranks(event.ranks)}"
        elif isinstance(event, WorkerFailed):
            text = f"rank {event.failure.rank} failed: {event.failure.headline}"
        elif isinstance(event, Restarting):
            text = f"restarting the group ({event.restart_count}/{event.max_restarts})"
        elif isinstance(event, ResizeRequested):
            when = "at the next commit" if event.graceful else "now"
            text = f"resize to {event.target} workers requested ({when})"
        elif isinstance(event, MembershipChanged):
            text = f"resizing: {event.old_nproc} -> {event.new_nproc} workers"
        elif isinstance(event, AcceptingNodes):
            text = f"other machines join this job with: {event.command}"
        elif isinstance(event, NodeConnected):
            verb = f"joined with {event.nproc} workers" if event.connected else "left"
            text = f"machine {event.peer} {verb}"
        elif isinstance(event, Committed) and event.origin == "checkpoint":
            text = f"resuming from the checkpoint of step {event.step}"
        elif isinstance(event, JobFinished):
            result = event.result
            text = f"{result.summary()}; logs: {result.log_dir}"
        else:
            return []
        return [("stdout", [f"[elastic] {text}"])]


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))
