"""Per-rank output: pipes read as produced, full logs on disk, bounded tails in memory."""

from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path

from ..events import EventSink, Output
from ..logs import private_file

TAIL_LINES = 200
_CHUNK = 1 << 16


class StreamPump(threading.Thread):
    """Reads one worker stream until EOF: every byte to the log, whole lines to events."""

    def __init__(
        self, fd: int, log_path: Path, *, rank: int, stream: str, attempt: int,
        emit: EventSink, tail: deque[str],
    ) -> None:
        super().__init__(name=f"elastic-{stream}-rank{rank}", daemon=True)
        self.fd = fd
        self.log_path = log_path
        self.rank = rank
        self.stream = stream
        self.attempt = attempt
        self.emit = emit
        self.tail = tail

    def run(self) -> None:
        pending = b""
        with open(self.log_path, "wb", opener=private_file) as log:
            while True:
                try:
                    chunk = os.read(self.fd, _CHUNK)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                *complete, pending = (pending + chunk).split(b"\n")
                if complete:
                    self._publish(complete)
            if pending:  # a last line without a newline is still a line
                self._publish([pending])
        os.close(self.fd)

    def _publish(self, raw_lines: list[bytes]) -> None:
        lines = tuple(line.decode("utf-8", "replace") for line in raw_lines)
        self.tail.extend(lines)
        self.emit(Output(self.rank, self.stream, lines, self.attempt))


def new_tail() -> deque[str]:
    return deque(maxlen=TAIL_LINES)
