"""State across machines: the head answering joined machines' State requests, and a joined
machine keeping its ranks' chunks (``chunks.py`` says where chunks live and how they
cross). Nothing here holds a chunk on the heap: they go from memory file to link to memory
file in pieces."""

from __future__ import annotations

import dataclasses
import os
import threading

from ...wire.chunk_messages import ChunkKept
from ...wire.link_messages import NodeReply, NodeRequest
from ...wire.messages import (
    Commit,
    CommitReply,
    Handoff,
    Reply,
    StateGet,
    StateReply,
    StateRequest,
)
from ..node.commit_files import CommitFiles, append, share
from ..node.snapshots import StateServer
from ..node.workers import Worker
from .chunks import (
    ChunkSink,
    HeldChunks,
    LinkLike,
    PeerCopier,
    memory_file,
    send_behind,
    send_snapshot,
)


def answer_node(chunks: ChunkSink, link: LinkLike, node: int, message: NodeRequest,
                server: StateServer, world_size: int) -> None:
    """The head answers a joined machine's worker: a commit whose chunk came in pieces, a
    restore sent in pieces but for the chunks that machine holds (none when the rank
    holds the commit in its memory), anything else inline."""
    attempt, local_rank, request = message.attempt, message.local_rank, message.request
    if isinstance(request, Commit) and message.streamed is not None:
        key = ("commit", attempt, local_rank, request.request_id)
        fd = chunks.take(node, key, message.streamed)
        reply = server.commit(request, world_size, fd) if fd is not None else CommitReply(
            error="the commit's chunk did not arrive whole from its machine")
        link.send(NodeReply(attempt, local_rank, Reply(request.request_id, reply)))
        return
    store = server.store
    if isinstance(request, StateGet) and store.source is not None \
            and not server.held_by_rank(request.held):
        # Sent on a thread, from our own descriptor of the memory file (a commit may
        # replace the store's meanwhile): the loop goes on serving.
        source = os.dup(store.source) if isinstance(store.source, int) else store.source
        state = Reply(request.request_id, StateReply(store.commit_id, token=store.token))
        threading.Thread(target=_send_state, name="elastic-chunk-send", daemon=True, args=(
            link, NodeReply(attempt, local_rank, state, streamed=store.size), source,
            store.token, message.have)).start()
        return
    link.send(NodeReply(attempt, local_rank, server.serve(request, world_size, inline=True)))


def _send_state(link: LinkLike, reply: NodeReply, source: bytes | int, token: int,
                have: tuple[tuple[int, int], ...]) -> None:
    """The snapshot in pieces (but for the chunks held there), then ``reply``."""
    key = ("state", reply.attempt, reply.local_rank, reply.reply.request_id)
    try:
        assert reply.streamed is not None
        local = send_snapshot(link, key, source, reply.streamed, token, have)
        if local is not None:
            link.send(dataclasses.replace(reply, local=local))
    except OSError:
        pass  # the link went: that machine is lost, which its reader reports
    finally:
        if isinstance(source, int):
            os.close(source)


class HeadCopies:
    """The head's ranks' chunks, copied to one joined machine (the first that joined and
    is still linked): for that machine's restores, and so that they outlive the head."""

    def __init__(self) -> None:
        self.copier: PeerCopier | None = None

    def copy(self, links: dict[int, LinkLike], request: StateRequest,
             memory_file: int | None, parts: CommitFiles) -> None:
        """Copy a local rank's chunk: in ``memory_file``, in the request, or written into
        the commit's file (``parts``)."""
        if not isinstance(request, Commit) or not links or not request.token:
            return
        if memory_file is not None:
            chunk = (os.dup(memory_file), 0, os.fstat(memory_file).st_size)
        elif request.snapshot is not None:
            chunk = (_in_memory_file(request.snapshot), 0, len(request.snapshot))
        elif request.written:
            fd, offset = parts.locate(request.token, request.sizes, request.part)
            chunk = (share(fd), offset, request.sizes[request.part])
        else:
            return
        if self.copier is None:
            self.copier = PeerCopier()
        self.copier.submit(links[min(links)], request.part, request.token, chunk)

    def close(self) -> None:
        if self.copier is not None:
            self.copier.close()


class NodeChunks:
    """A joined machine's side: its ranks' chunks kept here and sent to the head in pieces;
    the head's chunks kept here too; a restore put together from the chunks held here and
    the rest fetched from the head, then offered to the worker as a memory file."""

    def __init__(self, link: LinkLike, sink: ChunkSink) -> None:
        self.link = link
        self.sink = sink
        self.held = HeldChunks()
        self.asked: dict[tuple[int, int, int], StateGet] = {}  # restores under way
        # The last restore offered to the workers, (commit id, memory file): open until a
        # restore of another commit (a worker opens it some time after our reply); the
        # ranks restoring the same commit share it (the head's store numbers its commits
        # for the life of the job, as this role lives).
        self.served: tuple[int, int] | None = None

    def commit(self, worker: Worker, request: Commit, memory_file: int | None) -> None:
        """Keep the chunk here and send it to the head behind the loop; the head's reply
        (the commit kept there too) answers the worker."""
        fd = memory_file if memory_file is not None else _in_memory_file(
            request.snapshot or b"")
        size = os.fstat(fd).st_size
        self.held.keep(request.part, request.token, fd)
        key = ("commit", worker.attempt, worker.local_rank, request.request_id)
        plain = dataclasses.replace(request, snapshot=None, handoff=None)
        send_behind(self.link, key, os.dup(fd),
                    NodeRequest(worker.attempt, worker.local_rank, plain, streamed=size))

    def restore(self, worker: Worker, request: StateGet, *, everything: bool = False) -> None:
        self.asked[(worker.attempt, worker.local_rank, request.request_id)] = request
        have = () if everything else self.held.have()
        self.link.send(NodeRequest(worker.attempt, worker.local_rank, request, have=have))

    def kept(self, message: ChunkKept) -> None:
        fd = self.sink.take(0, ("copy", message.part, message.token, message.size),
                            message.size)
        if fd is not None:
            self.held.keep(message.part, message.token, fd)

    def answer(self, message: NodeReply, worker: Worker | None) -> None:
        """The head's answer to a restore: put together and offered to the worker."""
        request_id = message.reply.request_id
        request = self.asked.pop((message.attempt, message.local_rank, request_id), None)
        key = ("state", message.attempt, message.local_rank, request_id)
        fd = self.sink.take(0, key)
        assert fd is not None
        if worker is None or request is None:
            os.close(fd)
            return
        whole = all(self.held.copy_into(fd, part, token, offset)
                    for part, token, offset in message.local)
        if not whole or os.fstat(fd).st_size != message.streamed:
            os.close(fd)
            if not message.local:
                raise RuntimeError(f"a restore from the head came incomplete: "
                                   f"{message.streamed} bytes were announced")
            self.restore(worker, request, everything=True)  # a held chunk was replaced
            return
        state = message.reply.value
        assert isinstance(state, StateReply)
        if request.inline:
            reply = dataclasses.replace(state, snapshot=os.pread(fd, message.streamed, 0))
            os.close(fd)
        else:
            if self.served is not None and self.served[0] == state.commit_id:
                os.close(fd)  # the same commit: the file already offered
            else:
                self._release()
                self.served = (state.commit_id, fd)
            reply = dataclasses.replace(state, handoff=Handoff.of(self.served[1]))
        worker.send(Reply(request_id, reply))

    def _release(self) -> None:
        served, self.served = self.served, None
        if served is not None:
            os.close(served[1])

    def close(self) -> None:
        self.held.close()
        self._release()
        self.sink.drop()


def _in_memory_file(data: bytes) -> int:
    fd = memory_file()
    append(fd, data, len(data))
    return fd
