"""A rank's stdout: a line goes out at once, unless lines come faster than one per
``FLUSH_DELAY``; then they are buffered and flushed within ``FLUSH_DELAY``.

Unbuffered (PYTHONUNBUFFERED, which workers get so that output is never held back), every
``print`` is two system calls, and a rank that prints a lot runs at half the speed of one
writing to a file. Buffering everything would lose the last lines of a rank that is torn
down or killed, the ones that say what went wrong. So a line written after a quiet spell is
flushed at once; a flood is flushed by a thread that sleeps on an event while nothing is
pending (an idle rank costs nothing). Only the last ``FLUSH_DELAY`` of a flood can be lost
to a sudden death. stderr stays unbuffered. A fork (user code, DataLoader workers) flushes
first, so the child does not print the parent's lines again.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time

FLUSH_DELAY = 0.05  # seconds


class _TimedFlush(io.TextIOWrapper):
    pending: threading.Event
    flushed_at = 0.0

    def write(self, text: str) -> int:
        written = super().write(text)
        if "\n" in text and time.monotonic() - self.flushed_at >= FLUSH_DELAY:
            self.flush()  # a quiet stream: the line goes out now
        elif not self.pending.is_set():
            self.pending.set()
        return written

    def flush(self) -> None:
        self.flushed_at = time.monotonic()
        super().flush()


def buffer_stdout() -> None:
    """Replace ``sys.stdout`` (fd 1) with the timed-flush stream and start its thread."""
    old = sys.stdout
    if old is None:
        return
    with contextlib.suppress(OSError, ValueError):
        old.flush()
    raw = io.FileIO(1, "w", closefd=False)
    stream = _TimedFlush(io.BufferedWriter(raw, io.DEFAULT_BUFFER_SIZE * 8),
                         encoding=old.encoding, errors=old.errors, write_through=False)
    stream.pending = threading.Event()
    sys.stdout = stream

    def flush_soon() -> None:
        while True:
            stream.pending.wait()
            time.sleep(FLUSH_DELAY)
            stream.pending.clear()  # before the flush: a later write sets it again
            _flush(stream)

    threading.Thread(target=flush_soon, name="elastic-stdout", daemon=True).start()
    os.register_at_fork(before=lambda: _flush(stream))


def _flush(stream: io.TextIOBase) -> None:
    with contextlib.suppress(OSError, ValueError):  # closed by user code, a broken pipe
        stream.flush()
