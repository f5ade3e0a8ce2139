"""Per-rank output: pipes read as produced, full logs on disk, bounded tails in memory.

One thread per rank reads its stdout and stderr, so that what the rank printed reaches the
notebook in the order it was written across the two streams. The rank marks each turn from
one stream to the other with the next number of a shared count (``worker/stdout.py``):
once mark N has been read on one pipe, whatever the rank wrote before it on the other is in
that pipe, so reading that pipe to its end settles every piece before N. Pieces are shown
in order of their marks; the logs get each stream's bytes as they came, marks taken out.
Only marks with the rank's nonce are marks: anything else the rank printed is its text.
A session cell's end on a stream (``cell_end_mark``) is such a mark: its Output says so.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import BinaryIO

from ...wire.events import EventSink, Output
from ...worker.stdout import CELL_END, ORDER_END, order_mark

TAIL_LINES = 200
_CHUNK = 1 << 16
_END = ORDER_END.encode()
_SETTLED = float("inf")  # a stream that ended: nothing of it is still to come
_CELL_END = CELL_END.encode()


class _Lines:
    """One stream's bytes as lines: whole ones, and a line still being rewritten with \r
    (a progress bar) as it shows now."""

    def __init__(self) -> None:
        self.pending = b""  # the unfinished line, kept short: a bar rewrites it with \r
        self.rewriting = False  # it was rewritten with \r: publish it as it shows
        self.shown = b""  # what of it was last published as a partial line

    def feed(self, data: bytes) -> tuple[list[bytes], bytes | None] | None:
        """Lines to publish (None: nothing changed), and the partial line as it shows."""
        *complete, rest = (self.pending + data).split(b"\n")
        self.rewriting = (self.rewriting and not complete) or b"\r" in rest
        self.pending = _latest(rest)
        now = visible(self.pending) if self.rewriting else b""
        if not complete and now == self.shown:
            return None
        self.shown = now
        return complete, now or None

    def end(self) -> list[bytes]:
        """A last line without a newline is still a line (at a session cell's end too)."""
        pending, self.pending = self.pending, b""
        self.rewriting, self.shown = False, b""
        return [pending] if pending else []


class _Marks:
    """Splits a stream's bytes at the order marks (they start with ``mark``) into (order,
    data) pieces, holding back a mark that a read cut in two; a session cell's end mark is
    a piece of its own, (order, None)."""

    def __init__(self, mark: bytes) -> None:
        self.mark = mark
        self.longest = len(mark) + 20 + len(_END)  # a number of up to 20 digits
        self.order = 0  # the last mark read
        self.held = b""

    def split(self, chunk: bytes) -> list[tuple[int, bytes | None]]:
        data, self.held = self.held + chunk, b""
        pieces: list[tuple[int, bytes | None]] = []
        start = search = 0
        mark = self.mark
        while (at := data.find(mark, search)) >= 0:
            end = data.find(_END, at + len(mark))
            if end < 0 and len(data) - at < self.longest:
                self.held = data[at:]  # the rest of the mark comes with the next read
                data = data[:at]
                break
            number = data[at + len(mark):end] if end >= 0 else b""
            if number == _CELL_END:
                pieces += [(self.order, data[start:at]), (self.order, None)]
                start = search = end + len(_END)
                continue
            if not number.isdigit() or len(number) > 20:  # not ours: plain bytes
                search = at + 1
                continue
            pieces.append((self.order, data[start:at]))
            self.order = int(number)
            start = search = end + len(_END)
        else:
            cut = _cut_mark(data, start, mark)
            self.held, data = data[cut:], data[:cut]
        pieces.append((self.order, data[start:]))
        return [(order, piece) for order, piece in pieces if piece is None or piece]

    def rest(self) -> bytes:
        held, self.held = self.held, b""
        return held


def _cut_mark(data: bytes, start: int, mark: bytes) -> int:
    """Where a mark's beginning at the end of ``data`` starts (len(data): none)."""
    for size in range(min(len(mark) - 1, len(data) - start), 0, -1):
        if data.endswith(mark[:size]):
            return len(data) - size
    return len(data)


@dataclass
class _Stream:
    """A rank's stdout or stderr as its pump reads it: the pipe, its log, the marks read on
    it, and how far its pieces' place in the order is known."""

    name: str
    fd: int
    log: BinaryIO
    marks: _Marks
    lines: _Lines = field(default_factory=_Lines)
    # Every piece of this stream before this order has been read.
    settled: float = 0
    ended: bool = False
    other: _Stream | None = None  # the rank's other stream

    def read_before(self) -> float:
        """Every piece of this stream before this order has been read: the last mark read
        on it, or the other's last mark when this one was last read to its end."""
        return max(self.settled, self.marks.order)


class RankPump(threading.Thread):
    """Reads a worker's stdout and stderr until both end: every byte to its stream's log
    (``logs``: descriptors it then owns, see ``logs.RunFolder.create_logs``), whole lines
    to events in the order the rank wrote them; its order marks carry ``nonce``."""

    def __init__(
        self, fds: dict[str, int], logs: dict[str, int], *, rank: int, attempt: int,
        emit: EventSink, tail: deque[str], nonce: str,
    ) -> None:
        super().__init__(name=f"elastic-output-rank{rank}", daemon=True)
        self.fds = fds
        self.logs = logs
        self.rank = rank
        self.attempt = attempt
        self.emit = emit
        self.tail = tail
        self.mark = order_mark(nonce).encode()
        # (order, arrival, stream, data); data None: a session cell's output ends there
        self.read: list[tuple[int, int, str, bytes | None]] = []
        self.arrivals = 0

    def run(self) -> None:
        with contextlib.ExitStack() as files:
            streams = {name: _Stream(name, fd, files.enter_context(open(self.logs[name], "wb")),
                                     _Marks(self.mark))
                       for name, fd in self.fds.items()}
            out, err = streams.values()
            out.other, err.other = err, out
            try:
                self._pump(streams)
            finally:
                out.other = err.other = None  # no cycle left for the collector
        for stream in streams.values():
            os.close(stream.fd)

    def _pump(self, streams: dict[str, _Stream]) -> None:
        poller = select.poll()
        by_fd = {}
        for stream in streams.values():
            os.set_blocking(stream.fd, False)
            poller.register(stream.fd, select.POLLIN)
            by_fd[stream.fd] = stream
        while not all(s.ended for s in streams.values()):
            for fd, _ in poller.poll():
                stream = by_fd[fd]
                self._drain(stream)
                if stream.ended:
                    poller.unregister(fd)
            self._settle(streams)
        self._publish(streams, final=True)

    def _drain(self, stream: _Stream) -> None:
        """Read ``stream`` until its pipe is empty: then every piece the rank wrote on it
        before the last mark read on the other stream is here."""
        assert stream.other is not None
        before = stream.other.marks.order
        while True:
            try:
                chunk = os.read(stream.fd, _CHUNK)
            except BlockingIOError:
                stream.settled = max(stream.settled, before)
                return
            except OSError:
                chunk = b""
            pieces: list[tuple[int, bytes | None]]
            if not chunk:
                pieces = [(stream.marks.order, stream.marks.rest())]
                stream.ended, stream.settled = True, _SETTLED
            else:
                pieces = stream.marks.split(chunk)
            for order, data in pieces:
                if data == b"":
                    continue
                if data is not None:  # a cell's end mark is not the rank's: not logged
                    stream.log.write(data)
                self.read.append((order, self.arrivals, stream.name, data))
                self.arrivals += 1
            stream.log.flush()
            if stream.ended:
                return

    def _settle(self, streams: dict[str, _Stream]) -> None:
        """Read a stream again where the other turned to it since (so what came before the
        turn is read), then publish what is settled."""
        while unsettled := [s for s in streams.values() if not s.ended and s.other
                            and s.settled < s.other.marks.order]:
            for stream in unsettled:
                self._drain(stream)
            self._publish(streams)
        self._publish(streams)

    def _publish(self, streams: dict[str, _Stream], final: bool = False) -> None:
        """Events for the pieces read whose place in the order is settled, in order."""
        self.read.sort()
        ready = 0
        if final:
            ready = len(self.read)
        else:
            bounds = {name: s.other.read_before() for name, s in streams.items() if s.other}
            for order, _, name, _ in self.read:
                if order > bounds[name]:
                    break
                ready += 1
        pieces, self.read = self.read[:ready], self.read[ready:]
        run: list[bytes] = []
        for i, (_, _, name, data) in enumerate(pieces):
            if data is None:  # a session cell's output on this stream ends here
                self._lines(name, (streams[name].lines.end(), None), cell_end=True)
                continue
            run.append(data)
            after = pieces[i + 1] if i + 1 < len(pieces) else None
            if after is None or after[2] != name or after[3] is None:  # it turns or ends
                self._lines(name, streams[name].lines.feed(b"".join(run)))
                run = []
        if final:
            for stream in streams.values():
                self._lines(stream.name, (stream.lines.end(), None))

    def _lines(self, stream: str, got: tuple[list[bytes], bytes | None] | None,
               cell_end: bool = False) -> None:
        if got is None:
            return
        raw_lines, partial = got
        lines = tuple(visible(line).decode("utf-8", "replace") for line in raw_lines)
        self.tail.extend(lines)
        if partial is not None:
            lines += (partial.decode("utf-8", "replace"),)
        if not lines and not cell_end:
            return
        self.emit(Output(self.rank, stream, lines, self.attempt, partial=partial is not None,
                         cell_end=cell_end))


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
