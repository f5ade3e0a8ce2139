"""Where an agent stands in its job: alone on one machine, the head of several machines (the
kernel), or a machine that joined the head's job (``elastic-magic join``). A role owns its
links and threads and answers the loop's questions; the loop itself is the same for all.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from ..events import AcceptingNodes, EventSink, NetworkChosen, NodeConnected, Output
from ..messages import (
    Action,
    Commit,
    CommitReply,
    EndJob,
    Forward,
    GroupResult,
    Hello,
    JobOffer,
    Leaving,
    NodeFinished,
    NodeReply,
    NodeRequest,
    Regroup,
    Reply,
    Result,
    StateRequest,
)
from ..protocol import new_secret
from ..result import JobState, RankFailure
from ..spec import JobSpec
from .group import WorkerGroup
from .hub import HUB_KEY, FromLink, Hub, Link, read_into
from .network import choose
from .rendezvous import Rendezvous, RoundInfo, rendezvous_key
from .snapshots import StateServer
from .workers import Worker, take_handoff

if TYPE_CHECKING:
    from ..payload import Payload

# Waits for the next incoming message up to a timeout, handles it, and says what the loop
# must do about it (None: nothing).
NextAction = Callable[[float], Action | None]


def _take_memory_file(worker: Worker, request: StateRequest) -> int | Literal[False] | None:
    """The memory file a commit's snapshot is in, now ours; None for a snapshot sent as
    bytes; False when the file cannot be read here (the worker is told to use the pipe)."""
    if not isinstance(request, Commit) or request.handoff is None:
        return None
    memory_file = take_handoff(worker, request.handoff)
    if memory_file is None:
        worker.send(Reply(request.request_id, CommitReply(handoff_failed=True)))
        return False
    return memory_file


def join_command(endpoint: str, token: str) -> str:
    """What other machines run. The token goes in the environment, never on the command
    line, where every user of that machine would see it (ps)."""
    return f"ELASTIC_MAGIC_TOKEN={token} elastic-magic join {endpoint}"


class SingleMachine:
    """One machine: the kernel hosts the rendezvous and holds the snapshots."""

    hosts_rendezvous = True
    join_command: str | None = None
    network: NetworkChosen | None = None  # several machines: the interface workers use

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink) -> None:
        self.spec = spec
        self.run_id = run_id
        self.emit = emit
        self.stop_reason: str | None = None  # why a link asked this agent to stop
        self.node_failures: list[RankFailure] = []  # another machine's, for good
        # Signs what the rendezvous store holds: a secret of this job alone.
        self.rdzv_key = new_secret()

    def open(self) -> Rendezvous:
        spec = self.spec
        return Rendezvous(self.run_id, key=self.rdzv_key, host=spec.rdzv_host,
                          port=spec.rdzv_port, min_nodes=spec.min_nodes,
                          max_nodes=spec.max_nodes, join_timeout=spec.timeout)

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        return None  # no links

    def serve(self, worker: Worker, request: StateRequest, server: StateServer | None,
              world_size: int) -> None:
        """Answer a local rank's State request from the snapshots held here."""
        assert server is not None
        memory_file = _take_memory_file(worker, request)
        if memory_file is False:
            return
        if isinstance(request, Commit):
            reply = Reply(request.request_id, server.commit(request, world_size, memory_file))
        else:
            reply = server.serve(request, world_size, inline=False)
        worker.send(reply)

    def stop_requested(self, reason: str) -> None:
        """A stop for this agent (button, interrupt, signal), before its ranks go."""

    def stopping_job(self, reason: str) -> None:
        """This agent ends the job's workers (a stop, a failure for good)."""

    def regrouping(self) -> None:
        """This agent leaves its group for a new round."""

    def nodes_waiting(self, rendezvous: Rendezvous) -> bool:
        return False

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> JobState:
        return JobState.SUCCEEDED

    def other_ranks(self, info: RoundInfo | None) -> tuple[dict[int, Result],
                                                         dict[int, list[str]]]:
        """Results and output tails of ranks on other machines in round ``info``."""
        return {}, {}

    def finished(self, final: JobState, failures: list[RankFailure]) -> None:
        """The job has ended here: tell whoever must know, then close the links."""

    def close_rendezvous(self, rendezvous: Rendezvous | None) -> None:
        if rendezvous is not None:
            rendezvous.close(shutdown=True)


class Head(SingleMachine):
    """The kernel of a multi-node job: hosts the rendezvous and a hub that other machines
    join with the token; serves their State requests and collects their results."""

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink, *, token: str,
                 payload: Payload, inbox: queue.Queue[Any]) -> None:
        super().__init__(spec, run_id, emit)
        self.token = token
        self.rdzv_key = rendezvous_key(token)  # the machines that join hold the token too
        self.payload = payload
        self.inbox = inbox
        self.hub: Hub | None = None
        self.names: dict[int, str] = {}  # hub connection -> the machine's address
        self.results: dict[str, dict[int, GroupResult]] = {}  # round id -> node rank

    def open(self) -> Rendezvous:
        self.network = choose(self.spec.rdzv_host, self.spec.env)
        rendezvous = super().open()
        offer = JobOffer(self.run_id, self.spec, self.payload)
        try:
            self.hub = Hub(self.spec.rdzv_host, self.token, offer, self.inbox)
            rendezvous.publish(HUB_KEY, self.hub.address)
        except BaseException:
            self.close_rendezvous(rendezvous)
            raise
        self.join_command = join_command(rendezvous.endpoint, self.token)
        self.emit(self.network)
        self.emit(AcceptingNodes(rendezvous.endpoint, self.join_command))
        return rendezvous

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        match item.message:
            case Hello(host, nproc):
                self.names[item.node] = host
                self.emit(NodeConnected(host, nproc, True))
            case Forward(event):  # its ranks' output belongs to our current attempt here
                attempt = group.attempt if group else 0
                self.emit(dataclasses.replace(event, attempt=attempt)
                          if isinstance(event, Output) else event)
            case NodeRequest(attempt, local_rank, request):
                assert server is not None  # its workers cannot read our memory files
                item.link.send(NodeReply(attempt, local_rank,
                                         server.serve(request, world_size, inline=True)))
            case GroupResult() as result:
                self.results.setdefault(result.round_id, {})[result.node_rank] = result
            case NodeFinished(JobState.FAILED, failures) if failures:
                self.node_failures += failures  # that machine has no restarts left
                return Action.NODE_FAILED
            case Leaving():  # its ranks are about to go: regroup without them
                self._left(item.node)
                return Action.REGROUP
            case None:
                self._left(item.node, item.link.peer, item.reason)
        return None

    def _left(self, node: int, peer: str = "", reason: str | None = None) -> None:
        """A machine left; one whose link failed is reported even if it never said hello."""
        if node in self.names or reason:
            self.emit(NodeConnected(self.names.pop(node, peer), 0, False, reason or ""))

    def nodes_waiting(self, rendezvous: Rendezvous) -> bool:
        return rendezvous.num_nodes_waiting() > 0

    def stopping_job(self, reason: str) -> None:
        # Other machines hear first, so their ranks stop rather than fail on lost peers.
        if self.hub is not None:
            self.hub.broadcast(EndJob(reason))

    def regrouping(self) -> None:
        # Their ranks lose peers now: a membership change there too, not a failure.
        if self.hub is not None:
            self.hub.broadcast(Regroup())

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> JobState:
        """Wait for every other machine's results of this round."""
        deadline = time.monotonic() + self.spec.timeout
        while len(self.results.get(info.round_id, {})) < info.nnodes - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the other machines did not report their results within "
                                   f"{self.spec.timeout:.0f}s")
            action = next_action(self.spec.monitor_interval)
            if action is Action.STOP:
                return JobState.STOPPED
            if action is Action.NODE_FAILED:
                return JobState.FAILED
        return JobState.SUCCEEDED

    def other_ranks(self, info: RoundInfo | None) -> tuple[dict[int, Result],
                                                         dict[int, list[str]]]:
        results: dict[int, Result] = {}
        tails: dict[int, list[str]] = {}
        for node in self.results.get(info.round_id, {}).values() if info else ():
            results.update(node.results)
            tails.update(node.tails)
        return results, tails

    def finished(self, final: JobState, failures: list[RankFailure]) -> None:
        hub, self.hub = self.hub, None
        if hub is not None:
            try:
                hub.broadcast(EndJob(f"the job {final.value}"))
            finally:
                hub.close()


@dataclasses.dataclass(frozen=True)
class JoinedJob:
    """How an agent on another machine takes part in the head's job."""

    link: Link  # to the head's hub
    rdzv_endpoint: str  # the rendezvous store the head hosts
    host: str  # this machine's address as the others reach it
    rdzv_key: bytes  # what the head signs that store with (from the token)


class JoinedMachine(SingleMachine):
    """A machine that joined the head's job: it follows the head's rendezvous, proxies its
    workers' State requests to the head and reports its results there."""

    hosts_rendezvous = False

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink, joined: JoinedJob,
                 inbox: queue.Queue[Any]) -> None:
        super().__init__(spec, run_id, emit)
        self.link = joined.link
        self.joined = joined
        self.rdzv_key = joined.rdzv_key
        self._reader = threading.Thread(target=read_into, args=(self.link, 0, inbox),
                                        name="elastic-head", daemon=True)

    def open(self) -> Rendezvous:
        self._reader.start()
        self.network = choose(self.joined.host, self.spec.env)
        self.emit(self.network)  # printed here and forwarded to the notebook
        spec = self.spec
        return Rendezvous(self.run_id, key=self.rdzv_key, host=self.joined.host,
                          join=self.joined.rdzv_endpoint, min_nodes=spec.min_nodes,
                          max_nodes=spec.max_nodes, join_timeout=spec.timeout)

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        match item.message:
            case NodeReply(attempt, local_rank, reply):
                if group is not None and attempt == group.attempt \
                        and local_rank < len(group.workers):
                    group.workers[local_rank].send(reply)
            case Regroup():
                return Action.REGROUP
            case EndJob(reason):
                self.stop_reason = reason
                return Action.STOP
            case None:
                self.stop_reason = f"the link to the head failed: {item.reason}" \
                    if item.reason else "the head of the job (the notebook's kernel) went away"
                return Action.STOP
        return None

    def serve(self, worker: Worker, request: StateRequest, server: StateServer | None,
              world_size: int) -> None:
        """The head holds the snapshots: a snapshot in a memory file crosses as bytes."""
        memory_file = _take_memory_file(worker, request)
        if memory_file is False:
            return
        if memory_file is not None:
            assert isinstance(request, Commit) and request.handoff is not None
            try:
                data = os.pread(memory_file, request.handoff.size, 0)
            finally:
                os.close(memory_file)
            request = dataclasses.replace(request, snapshot=data, handoff=None)
        self.link.send(NodeRequest(worker.attempt, worker.local_rank, request))

    def stop_requested(self, reason: str) -> None:
        self.link.send(Leaving(reason))  # a membership change there, before our ranks go

    def nodes_waiting(self, rendezvous: Rendezvous) -> bool:
        return rendezvous.num_nodes_waiting() > 0

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> JobState:
        self.link.send(GroupResult(info.round_id, info.node_rank, group.results(),
                                   group.tails()))
        return JobState.SUCCEEDED

    def finished(self, final: JobState, failures: list[RankFailure]) -> None:
        try:
            self.link.send(NodeFinished(final, failures))
        finally:
            self.link.close()

    def close_rendezvous(self, rendezvous: Rendezvous | None) -> None:
        if rendezvous is not None:  # the run id stays open: the job belongs to the head
            rendezvous.close(shutdown=False)


def role_for(spec: JobSpec, run_id: str, emit: EventSink, inbox: queue.Queue[Any],
             payload: Payload, *, token: str | None, joined: JoinedJob | None
             ) -> SingleMachine:
    """This agent's role: a machine that joined, the head of several, or one alone."""
    if joined is not None:
        return JoinedMachine(spec, run_id, emit, joined, inbox)
    if spec.multi_node:
        assert token is not None
        return Head(spec, run_id, emit, token=token, payload=payload, inbox=inbox)
    return SingleMachine(spec, run_id, emit)
