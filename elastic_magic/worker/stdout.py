"""A rank's stdout and stderr: stdout buffered for speed, both kept in the order they were
written, though they reach the agent through two pipes.

Unbuffered (PYTHONUNBUFFERED, which workers get so that output is never held back), every
``print`` is two system calls, and a rank that prints a lot runs at half the speed of one
writing to a file. Buffering everything would lose the last lines of a rank that is torn
down or killed, the ones that say what went wrong. So a line written after a quiet spell is
flushed at once; a flood is flushed by a thread that sleeps on an event while nothing is
pending (an idle rank costs nothing). Only the last ``FLUSH_DELAY`` of a flood can be lost
to a sudden death. stderr stays unbuffered. A fork (user code, DataLoader workers) flushes
first, so the child does not print the parent's lines again.

The order across the two pipes: the agent reads each pipe as it fills, so it cannot tell
whether a line of stdout came before a traceback on stderr. Each time the rank turns from
one stream to the other, the stream it leaves is flushed and the one it turns to gets an
order mark with the next number of a count the two share (``order_mark``; the agent strips
it: ``agent/node/output.py``). By the time the agent reads mark N on one pipe, whatever
came before N on the other is in that pipe already. The mark carries a random nonce the
agent gives the rank through its control pipe before any user code runs: text the cell
prints that looks like a mark (a dataset record, a log replayed) lacks it, so stays text.
A session's cell ends its output on each stream with a mark of the same kind
(``cell_end_mark``): in place of the number, ``CELL_END``.
What bypasses ``sys.stdout``/``sys.stderr`` (C code, child processes) carries no marks and
keeps only its own stream's order.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from typing import TextIO

FLUSH_DELAY = 0.05  # seconds
# Written into a stream as order_mark(nonce) + decimal number + ORDER_END, never into the logs.
ORDER_END = "\x00"
NONCE_BYTES = 16
CELL_END = "end"
_cell_end = b""  # this rank's cell_end_mark, once buffer_stdout has its nonce


def order_mark(nonce: str) -> str:
    """How a rank's order marks start: ``nonce`` is the rank's, in hex."""
    return f"\x00elastic-magic-order:{nonce}:"


def cell_end_mark(nonce: str) -> str:
    """Ends a session cell's output on a stream (the agent waits for it on both before it
    reports the cell): text the cell printed cannot end it, lacking the nonce."""
    return f"{order_mark(nonce)}{CELL_END}{ORDER_END}"


def cell_end() -> bytes:
    """This rank's ``cell_end_mark``."""
    return _cell_end


class _Turns:
    """Which stream was written last, and the shared count of turns between them."""

    def __init__(self, mark: str) -> None:
        self.mark = mark
        self.lock = threading.RLock()
        self.last: _Ordered | None = None
        self.count = 0
        self.marking = True  # off in a forked child: its count would not be the parent's

    def turn_to(self, stream: _Ordered) -> str:
        """``stream`` is written after the other one: flush that one, and the mark that
        goes before the text (none for a rank's first write, or in a forked child)."""
        with self.lock:
            last, self.last = self.last, stream
            if last is None or last is stream or not self.marking:
                return ""
            _flush(last)  # before the mark: what came before is in its pipe first
            self.count += 1
            return f"{self.mark}{self.count}{ORDER_END}"


class _Ordered(io.TextIOWrapper):
    """A rank's stdout or stderr that puts an order mark before its text when the rank turns
    to it from the other stream."""

    turns: _Turns

    def write(self, text: str) -> int:
        # The check without the lock: writes from two threads at once have no order.
        if self.turns.last is not self and text:
            super().write(self.turns.turn_to(self) + text)  # mark and text in one write
            return len(text)
        return super().write(text)


class _TimedFlush(_Ordered):
    """The buffered stdout: a line after a quiet spell goes out at once, a flood within
    ``FLUSH_DELAY`` (its thread waits on ``pending``)."""

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


def buffer_stdout(nonce: str) -> None:
    """Replace ``sys.stdout`` (fd 1) with the timed-flush stream and start its thread, and
    ``sys.stderr`` (fd 2) with an unbuffered one; both mark their turns with ``nonce``."""
    global _cell_end
    _cell_end = cell_end_mark(nonce).encode()
    out, err = sys.stdout, sys.stderr
    if out is None or err is None:
        return
    for old in (out, err):
        _flush(old)
    turns = _Turns(order_mark(nonce))
    stream = _TimedFlush(io.BufferedWriter(io.FileIO(1, "w", closefd=False),
                                           io.DEFAULT_BUFFER_SIZE * 8),
                         encoding=out.encoding, errors=out.errors, write_through=False)
    stream.pending = threading.Event()
    stream.turns = turns
    # Unbuffered, as Python makes it under PYTHONUNBUFFERED: straight to the descriptor.
    stderr = _Ordered(io.FileIO(2, "w", closefd=False), encoding=err.encoding,
                      errors=err.errors, write_through=True)
    stderr.turns = turns
    sys.stdout, sys.stderr = stream, stderr

    def flush_soon() -> None:
        while True:
            stream.pending.wait()
            time.sleep(FLUSH_DELAY)
            stream.pending.clear()  # before the flush: a later write sets it again
            _flush(stream)

    def in_child() -> None:
        turns.marking = False
        turns.lock = threading.RLock()  # another thread may have held it at the fork

    threading.Thread(target=flush_soon, name="elastic-stdout", daemon=True).start()
    os.register_at_fork(before=lambda: _flush(stream), after_in_child=in_child)


def _flush(stream: TextIO) -> None:
    with contextlib.suppress(OSError, ValueError):  # closed by user code, a broken pipe
        stream.flush()
