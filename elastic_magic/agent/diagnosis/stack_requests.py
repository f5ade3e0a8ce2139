"""Every rank's Python stacks on request, without stopping anything: asked by the kernel
(``Job.stacks``, ``%elastic stacks``), by the head of a multi-node job of the machines that
joined it, or by the hang diagnosis (``hangs.py``) before it names a rank. A gathering asks
this machine's ranks (and the role's other machines), and answers once all have answered or
its deadline passed; a rank that cannot answer is said to be silent."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from dataclasses import dataclass, field
from typing import Protocol

from ...stacks import RankStacks
from ...wire.link_messages import NodeStacks, StacksRequest
from ...wire.messages import DumpStacks, Stacks, StacksCommand
from ..inbox import FromLink, InboxItem, WorkerReport
from ..node.group import WorkerGroup
from ..node.workers import Worker, WorkerState


class StackPeers(Protocol):
    """The other machines whose ranks' stacks this machine asks for: the role answers
    (the head has its joined machines; others have none)."""

    def peers_for_stacks(self) -> set[int]: ...

    def ask_peers_for_stacks(self, request_id: int) -> None: ...


STACKS_DEADLINE = 2.0  # a rank that has not sent its stacks by then is reported as silent
REMOTE_DEADLINE = 4.0  # other machines first gather their own ranks' stacks
NOT_ANSWERING = (f"did not answer within {STACKS_DEADLINE:.0f}s (stuck in C code that holds "
                 "the GIL?)")
FINISHED = "finished: its cell returned; it waits for the other ranks"
EXITED = "exited before it could answer"


@dataclass
class Gathering:
    """Stacks asked of this machine's ranks (and of other machines), kept until all have
    answered or the deadline passed."""

    request_id: int
    deadline: float
    asked: dict[tuple[int, int], int]  # (attempt, local rank) -> global rank, unanswered
    nodes: set[int]  # other machines (hub connections) that have not answered
    on_done: Callable[[Gathering], None] | None = None
    stacks: dict[int, RankStacks] = field(default_factory=dict)  # this machine's ranks
    remote: dict[int, str] = field(default_factory=dict)  # other machines' ranks, as text
    done: bool = False

    def complete(self, now: float) -> bool:
        return (not self.asked and not self.nodes) or now >= self.deadline

    def finish(self) -> None:
        for rank in self.asked.values():
            self.stacks[rank] = RankStacks(rank, note=NOT_ANSWERING)
        self.asked.clear()
        self.done = True
        if self.on_done is not None:
            self.on_done(self)

    def texts(self) -> dict[int, str]:
        found = {rank: stacks.format() for rank, stacks in self.stacks.items()}
        return dict(sorted({**found, **self.remote}.items()))


def _ask(worker: Worker, message: DumpStacks) -> bool:
    if worker.control is None:
        return False
    try:
        worker.control.send(message)
        return True
    except OSError:
        return False


class StackRequests:
    """The gatherings under way on this machine, on the agent thread."""

    def __init__(self, role: StackPeers) -> None:
        self.role = role  # which other machines to ask, and how
        self._ids = itertools.count(1)
        self.gatherings: dict[int, Gathering] = {}

    def handle(self, item: InboxItem, group: WorkerGroup | None) -> bool:
        """Take ``item`` if it is about stacks (asked or answered): True when it was."""
        match item:
            case StacksCommand():
                self.request(item, group)
            case WorkerReport(attempt, local, Stacks(request_id, threads)):
                gathering = self.gatherings.get(request_id)
                rank = gathering.asked.pop((attempt, local), None) if gathering else None
                if gathering is not None and rank is not None:
                    gathering.stacks[rank] = RankStacks(rank, threads)
                self.tick(time.time())
            case FromLink(link, _, StacksRequest(request_id)):  # the head asks this machine

                def answer(gathering: Gathering) -> None:
                    link.send(NodeStacks(request_id, gathering.texts()))

                self.gather(group, answer)
            case FromLink(_, node, NodeStacks(request_id, stacks)):  # a machine answers
                gathering = self.gatherings.get(request_id)
                if gathering is not None:
                    gathering.remote.update(stacks)
                    gathering.nodes.discard(node)
                self.tick(time.time())
            case _:
                return False
        return True

    def request(self, command: StacksCommand, group: WorkerGroup | None) -> None:
        """Someone asked for every rank's stacks (``Job.stacks``)."""
        answer = command.answer

        def reply(gathering: Gathering) -> None:
            with contextlib.suppress(InvalidStateError):  # the asker gave up
                answer.set_result(gathering.texts())

        nodes = self.role.peers_for_stacks()
        gathering = self.gather(group, reply, nodes=nodes)
        if nodes:
            self.role.ask_peers_for_stacks(gathering.request_id)

    def gather(self, group: WorkerGroup | None, on_done: Callable[[Gathering], None] | None,
               *, nodes: set[int] | None = None) -> Gathering:
        """Ask every live rank of ``group`` (and ``nodes``, which the caller asks) for its
        stacks; ``on_done`` gets the gathering once it is complete."""
        now = time.time()
        gathering = Gathering(next(self._ids), now + (REMOTE_DEADLINE if nodes else
                                                      STACKS_DEADLINE), {}, set(nodes or ()),
                              on_done)
        for worker in group.workers if group is not None else ():
            rank = worker.global_rank
            if worker.state is WorkerState.SUCCEEDED:
                gathering.stacks[rank] = RankStacks(rank, note=FINISHED)
            elif worker.error is None and worker.alive() \
                    and _ask(worker, DumpStacks(gathering.request_id)):
                gathering.asked[(worker.attempt, worker.local_rank)] = rank
        self.gatherings[gathering.request_id] = gathering
        self.tick(now)
        return gathering

    def tick(self, now: float) -> None:
        """Complete the gatherings that have all their answers, or whose time is up."""
        for request_id, gathering in list(self.gatherings.items()):
            if gathering.complete(now):
                del self.gatherings[request_id]
                gathering.finish()

    def drop_gone(self, group: WorkerGroup) -> None:
        """A rank that has exited cannot answer: stop waiting for it."""
        if not any(g.asked for g in self.gatherings.values()):
            return
        gone = {(w.attempt, w.local_rank) for w in group.workers if not w.alive()}
        for gathering in self.gatherings.values():
            for key in gone & gathering.asked.keys():
                rank = gathering.asked.pop(key)
                gathering.stacks[rank] = RankStacks(rank, note=EXITED)

    def close(self) -> None:
        """The job ends: answer whoever still waits with what has arrived."""
        self.tick(float("inf"))
