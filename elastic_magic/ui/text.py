"""Plain-text renderer: each rank's lines with a ``[rank N]`` prefix, plus status lines."""

from __future__ import annotations

import sys
from typing import TextIO

from ..events import Event, Output
from .describe import describe


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
        note = describe(event) if self.status else None
        return [("stdout", [f"[elastic] {note.text}"])] if note else []
