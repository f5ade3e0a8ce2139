"""Snapshot chunks between machines, as units (``agent/machines/chunks.py``): a snapshot
sent in pieces but for the parts the peer holds, put together there from the pieces and
its own chunks, byte for byte; pieces never larger than PIECE; a chunk that did not come
whole, or a held chunk replaced by a newer commit's, is never used. The machines
themselves: tests/test_sharded.py (a joined machine lost) and test_multinode.py."""

from __future__ import annotations

import os

import pytest

from elastic_magic.agent.machines import chunks
from elastic_magic.agent.machines.chunks import ChunkSink, HeldChunks, memory_file, send_snapshot
from elastic_magic.training.snapshot_format import parts_header
from elastic_magic.wire.chunk_messages import ChunkPiece

pytestmark = pytest.mark.unit


class Wire:
    """A link that delivers every piece to a sink, as the reader thread does."""

    def __init__(self, sink: ChunkSink) -> None:
        self.sink = sink
        self.sizes: list[int] = []

    def send(self, message) -> bool:
        assert isinstance(message, ChunkPiece)
        self.sizes.append(len(message.data))
        self.sink.write(0, message)
        return True


def _file(data: bytes) -> int:
    fd = memory_file()
    os.write(fd, data)
    return fd


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


PARTS = [b"a" * 7, b"b" * 11, b"c" * 5]
SNAPSHOT = parts_header([len(p) for p in PARTS]) + b"".join(PARTS)


@pytest.mark.parametrize("source", ["bytes", "memory file"])
@pytest.mark.parametrize("held", [(), (1,), (0, 2), (0, 1, 2)])
def test_a_restore_is_the_snapshot_from_pieces_and_held_chunks(monkeypatch, source, held):
    monkeypatch.setattr(chunks, "PIECE", 4)
    sink = ChunkSink()
    wire, mine = Wire(sink), HeldChunks()
    if 1 not in held:
        mine.keep(1, 41, _file(b"x" * 11))  # an older commit's: dropped by the newer's
    for part in held:
        mine.keep(part, 42, _file(PARTS[part]))
    data = SNAPSHOT if source == "bytes" else _file(SNAPSHOT)
    local = send_snapshot(wire, ("state", 1, 0, 9), data, len(SNAPSHOT), 42, mine.have())
    assert [part for part, _, _ in (local or ())] == list(held)
    assert max(wire.sizes, default=0) <= 4
    assert sum(wire.sizes) == len(SNAPSHOT) - sum(len(PARTS[p]) for p in held)
    out = sink.take(0, ("state", 1, 0, 9))
    assert out is not None
    assert all(mine.copy_into(out, part, token, offset) for part, token, offset in local)
    assert _read(out) == SNAPSHOT
    os.close(out)
    mine.close()


def test_a_snapshot_of_one_part_held_whole_sends_nothing():
    sink, mine = ChunkSink(), HeldChunks()
    mine.keep(0, 7, _file(b"whole"))
    wire = Wire(sink)
    assert send_snapshot(wire, ("state", 1, 0, 1), b"whole", 5, 7, mine.have()) == ((0, 7, 0),)
    assert wire.sizes == []
    # A snapshot with no token (loaded from a checkpoint) never matches a held chunk.
    assert send_snapshot(wire, ("state", 1, 0, 2), b"whole", 5, 0, ((0, 0),)) == ()
    mine.close()
    sink.drop()


def test_a_held_chunk_replaced_by_a_newer_commit_is_not_used():
    mine = HeldChunks()
    mine.keep(0, 1, _file(b"old"))
    mine.keep(0, 2, _file(b"new"))
    out = memory_file()
    assert not mine.copy_into(out, 0, 1, 0) and _read(out) == b""
    assert mine.copy_into(out, 0, 2, 0) and _read(out) == b"new"
    assert mine.have() == ((0, 2),)
    mine.keep(1, 2, _file(b"one"))
    mine.keep(2, 3, _file(b"two"))  # a newer commit: the chunks of the older are dropped
    assert mine.have() == ((2, 3),)
    os.close(out)
    mine.close()


def test_a_chunk_that_did_not_come_whole_is_refused():
    sink = ChunkSink()
    sink.write(3, ChunkPiece(("commit", 1, 0, 5), 0, b"abc"))
    assert sink.take(3, ("commit", 1, 0, 5), 4) is None  # one byte short
    assert sink.take(3, ("commit", 1, 0, 6), 4) is None  # nothing came
    sink.write(3, ChunkPiece(("commit", 1, 0, 7), 2, b"cd"))
    sink.write(3, ChunkPiece(("commit", 1, 0, 7), 0, b"ab"))
    fd = sink.take(3, ("commit", 1, 0, 7), 4)
    assert fd is not None and _read(fd) == b"abcd"
    os.close(fd)
