"""The role of an agent on a machine that joined the head's job (``elastic-magic join``): it
follows the head's rendezvous, keeps its ranks' snapshot chunks (and a copy of the head's),
sends them to the head, fetches the others' for a restore, and reports its results (a
session's cells too) there."""

from __future__ import annotations

import dataclasses
import threading
import time

from ...result import JobState, RankFailure
from ...spec import JobSpec
from ...wire.chunk_messages import ChunkKept
from ...wire.events import EventSink
from ...wire.link_messages import (
    EndJob,
    GroupResult,
    Leaving,
    LinkMessage,
    NodeFinished,
    NodeReply,
    NodeRequest,
    Regroup,
    ReleaseAtCommit,
)
from ...wire.messages import (
    Action,
    Commit,
    CommitReply,
    CommitTarget,
    Reply,
    StateGet,
    StateRequest,
)
from ..inbox import FromLink, Inbox
from ..node.group import WorkerGroup
from ..node.network import choose
from ..node.snapshots import StateServer
from ..node.workers import Worker, take_memory_file
from ..policy import GroupOutcome
from ..round_info import RoundInfo
from .chunks import ChunkSink
from .hub import Link, read_into
from .remote_state import NodeChunks
from .rendezvous import Rendezvous
from .roles import NextAction, SingleMachine


@dataclasses.dataclass(frozen=True)
class JoinedJob:
    """How an agent on another machine takes part in the head's job."""

    link: Link  # to the head's hub
    rdzv_endpoint: str  # the rendezvous store the head hosts
    host: str  # this machine's address as the others reach it
    rdzv_key: bytes  # what the head signs that store with (from the token)


class JoinedMachine(SingleMachine):
    """A machine that joined the head's job: it follows the head's rendezvous, keeps its
    ranks' chunks and sends their copies to the head (``remote_state.NodeChunks``), and
    reports its results there. It does not watch for waiting machines itself (the head
    does, and says Regroup): a read of the head's store could block its loop for the
    store's timeout on a cut link, long after the link's own timeout has said that the
    head is lost."""

    hosts_rendezvous = False
    holds_snapshots = False

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink, joined: JoinedJob,
                 inbox: Inbox) -> None:
        super().__init__(spec, run_id, emit)
        self.link = joined.link
        self.head_lost = False
        self.released: str | None = None  # the head gave this machine back: why
        self.joined = joined
        self.rdzv_key = joined.rdzv_key
        sink = ChunkSink()  # chunks from the head, written as they arrive
        self.chunks = NodeChunks(self.link, sink)
        self._reader = threading.Thread(target=read_into, args=(self.link, 0, inbox, sink),
                                        name="elastic-head", daemon=True)

    def open(self) -> Rendezvous:
        self._reader.start()
        self.network = choose(self.joined.host, self.spec.env)
        self.emit(self.network)  # printed here and forwarded to the notebook
        spec = self.spec
        return Rendezvous(self.run_id, key=self.rdzv_key, host=self.joined.host,
                          join=self.joined.rdzv_endpoint, min_nodes=spec.min_nodes,
                          max_nodes=spec.max_nodes, join_timeout=spec.timeout,
                          last_call_timeout=spec.last_call)

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        match item.message:
            case NodeReply(attempt, local_rank, reply, streamed):
                worker = group.workers[local_rank] if group is not None \
                    and attempt == group.attempt and local_rank < len(group.workers) else None
                if streamed is not None:  # a restore, in pieces
                    self.chunks.answer(item.message, worker)
                else:  # whole: a restore among them (one the rank holds in its memory)
                    self.chunks.asked.pop((attempt, local_rank, reply.request_id), None)
                    if worker is not None:
                        worker.send(reply)
            case ChunkKept() as kept:
                self.chunks.kept(kept)
            case Regroup():
                return Action.REGROUP
            case ReleaseAtCommit(reason):  # the group leaves at its commit; we go then
                self.released = reason
            case EndJob(reason):
                self.stop_reason = reason
                return Action.STOP
            case None:
                # The job cannot go on here without the head: stop the workers, and fail
                # (a scheduler sees this machine's agent end in error).
                why = f"the link to the head failed: {item.reason}" if item.reason \
                    else "the head of the job (the notebook's kernel) went away"
                self.head_lost = True
                self.node_failures.append(RankFailure(
                    rank=-1, local_rank=-1, attempt=group.attempt if group else 0, pid=0,
                    time=time.time(), reason=f"lost the head at {self.link.peer}: {why}"))
                return Action.NODE_FAILED
        return None

    def serve(self, worker: Worker, request: StateRequest, server: StateServer | None,
              world_size: int) -> None:
        """A commit's chunk stays here and crosses to the head in pieces; a restore takes
        the chunks held here and fetches the rest; the head answers the rest."""
        memory_file = take_memory_file(worker, request)
        if memory_file is False:
            return
        match request:
            case Commit():
                self.chunks.commit(worker, request, memory_file)
            case StateGet():
                self.chunks.restore(worker, request)
            case CommitTarget():  # the part is kept here: the worker writes its own file
                worker.send(Reply(request.request_id, CommitReply()))
            case _:
                self.link.send(NodeRequest(worker.attempt, worker.local_rank, request))

    def leaves_before_round(self) -> bool:
        if self.released is not None:
            self.stop_reason = f"left the job at a commit: {self.released}"
        return self.released is not None

    def stop_requested(self, reason: str) -> None:
        self.link.send(Leaving(reason))  # a membership change there, before our ranks go

    def reforming(self, info: RoundInfo | None) -> None:
        if info is not None:  # the head regroups every machine
            self.link.send(Regroup(info.round_id))

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> GroupOutcome:
        self.link.send(GroupResult(info.round_id, info.node_rank, group.results(),
                                   group.tails()))
        return GroupOutcome.SUCCEEDED

    def send_to_head(self, message: LinkMessage) -> None:
        self.link.send(message)

    def finished(self, final: JobState, failures: list[RankFailure]) -> None:
        try:
            self.link.send(NodeFinished(final, failures))
        finally:
            self.link.close()
            self.chunks.close()

    def close_rendezvous(self, rendezvous: Rendezvous | None) -> None:
        if rendezvous is None:  # the run id stays open: the job belongs to the head
            return
        if self.head_lost:
            # torch's rendezvous heartbeat thread may wait on the lost head's store for the
            # store's timeout (a minute), and releasing the handler joins it. This agent is
            # about to exit (elastic-magic join): it does not wait for that thread.
            threading.Thread(target=rendezvous.close, kwargs={"shutdown": False},
                             name="elastic-rendezvous-close", daemon=True).start()
        else:
            rendezvous.close(shutdown=False)
