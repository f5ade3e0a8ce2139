"""Per-rank output: pipes read as produced, full logs on disk, bounded tails in memory."""

from __future__ import annotations

import os
import threading
from collections import deque

from ...events import EventSink, Output

TAIL_LINES = 200
_CHUNK = 1 << 16


class StreamPump(threading.Thread):
    """Reads one worker stream until EOF: every byte to the log (``log``, a descriptor it
    then owns: see ``logs.RunFolder.create_logs``), whole lines to events."""

    def __init__(
        self, fd: int, log: int, *, rank: int, stream: str, attempt: int,
        emit: EventSink, tail: deque[str],
    ) -> None:
        super().__init__(name=f"elastic-{stream}-rank{rank}", daemon=True)
        self.fd = fd
        self.log = log
        self.rank = rank
        self.stream = stream
        self.attempt = attempt
        self.emit = emit
        self.tail = tail

    def run(self) -> None:
        pending = b""  # the unfinished line, kept short: a progress bar rewrites it with \r
        rewriting = False  # it was rewritten with \r: publish it as it shows, while it lasts
        shown = b""  # what of it was last published as a partial line
        with open(self.log, "wb") as log:
            while True:
                try:
                    chunk = os.read(self.fd, _CHUNK)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                *complete, rest = (pending + chunk).split(b"\n")
                rewriting = (rewriting and not complete) or b"\r" in rest
                pending = _latest(rest)
                now = visible(pending) if rewriting else b""
                if complete or now != shown:
                    self._publish(complete, now or None)
                    shown = now
            if pending:  # a last line without a newline is still a line
                self._publish([pending])
        os.close(self.fd)

    def _publish(self, raw_lines: list[bytes], partial: bytes | None = None) -> None:
        lines = tuple(visible(line).decode("utf-8", "replace") for line in raw_lines)
        self.tail.extend(lines)
        if partial is not None:
            lines += (partial.decode("utf-8", "replace"),)
        if not lines:
            return
        self.emit(Output(self.rank, self.stream, lines, self.attempt,
                         partial=partial is not None))


def visible(line: bytes) -> bytes:
    """What a terminal shows of a line rewritten with carriage returns: its last non-empty
    part (a bar ends each update with \r, or starts it with one; \r\n ends a line)."""
    if b"\r" not in line:
        return line
    return next((part for part in reversed(line.split(b"\r")) if part), b"")


def _latest(pending: bytes) -> bytes:
    """An unfinished line less the updates it no longer shows (2000 updates of a bar are
    326 KB), keeping a trailing \r: the next update starts over."""
    if b"\r" not in pending:
        return pending
    return visible(pending) + (b"\r" if pending.endswith(b"\r") else b"")


def new_tail() -> deque[str]:
    return deque(maxlen=TAIL_LINES)
