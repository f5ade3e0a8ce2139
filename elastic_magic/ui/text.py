"""Plain-text renderer: each rank's lines with a ``[rank N]`` prefix, plus status lines."""

from __future__ import annotations

import sys
from collections import deque
from typing import TextIO

from ..result import JobResult
from ..wire.events import Event, Output
from . import ansi
from .describe import describe

TAIL = 200  # stderr lines kept per rank: where a failure's traceback is looked for


class TextRenderer:
    """Writes batches of events to stdout/stderr (resolved at write time: IPython swaps
    ``sys.stdout`` per cell), one write per stream run, in event order.

    Lines that ranks rewrite with carriage returns (progress bars) share one last line per
    stream, ``[rank 0] ... · [rank 1] ...``, rewritten in place (``\\r``) as they change;
    whole lines are written above it.

    A rank's colours are kept (``ansi.for_terminal``): a terminal shows them, and so does
    Jupyter, for this text stream as for a plain cell's; cursor moves and erases are dropped,
    since they would move over other ranks' lines and the ``[rank N]`` prefixes."""

    def __init__(self, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 status: bool = True) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self.status = status
        self._bars: dict[str, dict[int, str]] = {}  # stream -> rank -> its line as it shows
        self._open: dict[str, int] = {}  # stream -> width of its bar line (no newline yet)
        self._stderr_tails: dict[int, deque[str]] = {}  # rank -> its last whole stderr lines

    def printed(self, result: JobResult) -> bool:
        """Whether the root cause's traceback was printed, whole, from its rank's stderr
        (then the error need not repeat it)."""
        failure = result.failure
        if failure is None or not failure.traceback:
            return False
        trace = failure.traceback.rstrip("\n").splitlines()
        tail = list(self._stderr_tails.get(failure.rank, ()))
        return any(tail[i:i + len(trace)] == trace for i in range(len(tail) - len(trace) + 1))

    def __call__(self, events: list[Event]) -> None:
        runs: list[tuple[str, list[str]]] = []  # (stream, lines), merged while stream repeats
        changed: set[str] = set()
        for event in events:
            if isinstance(event, Output):
                if event.stream == "stderr":
                    self._stderr_tails.setdefault(event.rank, deque(maxlen=TAIL)).extend(
                        event.lines[:-1] if event.partial else event.lines)
                bars = self._bars.setdefault(event.stream, {})
                if event.partial:
                    bars[event.rank] = ansi.for_terminal(event.lines[-1])
                    changed.add(event.stream)
                elif bars.pop(event.rank, None) is not None:
                    changed.add(event.stream)
            for stream, lines in self._lines(event):
                if not lines:
                    continue
                if runs and runs[-1][0] == stream:
                    runs[-1][1].extend(lines)
                else:
                    runs.append((stream, list(lines)))
        if runs:  # whole lines go above the bar lines, which are drawn again below them
            changed.update(self._open)
            self._clear_bars()
        for stream, lines in runs:
            out = self._stream(stream)
            out.write("\n".join(lines) + "\n")
            out.flush()
        for stream in sorted(changed):
            self._draw_bar(stream)

    def _clear_bars(self) -> None:
        for stream, width in self._open.items():
            self._stream(stream).write("\r" + " " * width + "\r")
        self._open.clear()

    def _draw_bar(self, stream: str) -> None:
        out = self._stream(stream)
        text = " · ".join(f"[rank {rank}] {line}"
                          for rank, line in sorted(self._bars.get(stream, {}).items()))
        width = self._open.pop(stream, 0)
        if width:
            out.write("\r" + " " * width + "\r")
        if text:
            out.write(text)
            self._open[stream] = len(ansi.plain(text))  # what it takes on the screen
        out.flush()

    def _stream(self, name: str) -> TextIO:
        if name == "stderr":
            return self._stderr or sys.stderr
        return self._stdout or sys.stdout

    def _lines(self, event: Event) -> list[tuple[str, list[str]]]:
        if isinstance(event, Output):
            prefix = f"[rank {event.rank}] "
            lines = event.lines[:-1] if event.partial else event.lines
            return [(event.stream, [prefix + ansi.for_terminal(line) for line in lines])]
        note = describe(event) if self.status else None
        return [("stdout", [f"[elastic] {note.text}"])] if note else []
