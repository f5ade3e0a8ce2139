"""Where an agent stands in its job: alone on one machine (here), the head of several machines
(the kernel, ``head.py``), or a machine that joined the head's job (``elastic-magic join``,
``joined.py``). A role owns its links and threads and answers the engine's and the loops'
questions, so that no code asks which role it holds; the loops themselves are the same for
all."""

from __future__ import annotations

from collections.abc import Callable

from ...result import JobState, RankFailure
from ...spec import JobSpec
from ...wire.events import EventSink, NetworkChosen
from ...wire.link_messages import LinkMessage
from ...wire.messages import Action, Commit, Reply, Result, StateRequest
from ...wire.protocol import new_secret
from ..inbox import FromLink
from ..node.group import WorkerGroup
from ..node.snapshots import StateServer
from ..node.workers import Worker, take_memory_file
from ..policy import GroupOutcome
from ..round_info import RoundInfo
from .rendezvous import Rendezvous

# Waits for the next incoming message up to a timeout, handles it, and says what the loop
# must do about it (None: nothing).
NextAction = Callable[[float], Action | None]


class SingleMachine:
    """One machine: the kernel hosts the rendezvous and holds the snapshots."""

    hosts_rendezvous = True
    holds_snapshots = True  # a joined machine asks the head for State
    join_command: str | None = None
    network: NetworkChosen | None = None  # several machines: the interface workers use

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink) -> None:
        self.spec = spec
        self.run_id = run_id
        self.emit = emit
        self.stop_reason: str | None = None  # why a link asked this agent to stop
        # the engine's: a group that commits State is running (set by the engine)
        self.graceful: Callable[[], bool] = lambda: False
        self.node_failures: list[RankFailure] = []  # another machine's, for good
        self.excluded: list[str] = []  # machines the job went on without, and why
        # Signs what the rendezvous store holds: a secret of this job alone.
        self.rdzv_key = new_secret()

    def open(self) -> Rendezvous:
        spec = self.spec
        return Rendezvous(self.run_id, key=self.rdzv_key, host=spec.rdzv_host,
                          port=spec.rdzv_port, min_nodes=spec.min_nodes,
                          max_nodes=spec.max_nodes, join_timeout=spec.timeout,
                          last_call_timeout=spec.last_call)

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        return None  # no links

    def serve(self, worker: Worker, request: StateRequest, server: StateServer | None,
              world_size: int) -> None:
        """Answer a local rank's State request from the snapshots held here."""
        assert server is not None
        memory_file = take_memory_file(worker, request)
        if memory_file is False:
            return
        if isinstance(request, Commit):
            self.copy_chunk(request, memory_file, server)
            reply = Reply(request.request_id, server.commit(request, world_size, memory_file))
        else:
            reply = server.serve(request, world_size, inline=False)
        worker.send(reply)

    def copy_chunk(self, commit: Commit, memory_file: int | None,
                   server: StateServer) -> None:
        """A local rank's chunk, before the store takes it: copied to another machine."""

    def take_release(self) -> bool:
        """A machine is to leave: the group leaves at this commit (once)."""
        return False

    def leaves_before_round(self) -> bool:
        """This machine was given back: it joins no further round."""
        return False

    def stop_requested(self, reason: str) -> None:
        """A stop for this agent (button, interrupt, signal), before its ranks go."""

    def stopping_job(self, reason: str) -> None:
        """This agent ends the job's workers (a stop, a failure for good)."""

    def regrouping(self, info: RoundInfo | None) -> None:
        """This agent leaves its group (of round ``info``) for a new round."""

    def reforming(self, info: RoundInfo | None) -> None:
        """This agent's group (of round ``info``) failed and a new one follows (a restart,
        a slot left out): the other machines' ranks lose their peers, a regroup there."""

    def nodes_waiting(self, rendezvous: Rendezvous) -> bool:
        return False

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> GroupOutcome:
        """This machine's group succeeded in round ``info``: what ended the round for the
        job (SUCCEEDED, or STOP, REGROUP, NODE_FAILED heard before the others were done)."""
        return GroupOutcome.SUCCEEDED

    def peers_for_stacks(self) -> set[int]:
        """The other machines to ask for their ranks' stacks (hub connections)."""
        return set()

    def ask_peers_for_stacks(self, request_id: int) -> None:
        """Ask those machines; their answers come to the inbox as NodeStacks."""

    def broadcast(self, message: LinkMessage) -> None:
        """Tell every machine that joined this one (a session's cells, interrupts)."""

    def send_to_head(self, message: LinkMessage) -> None:
        """Tell the head of the job (a joined session's reports); here, nobody."""

    def other_ranks(self, info: RoundInfo | None) -> tuple[dict[int, Result],
                                                         dict[int, list[str]]]:
        """Results and output tails of ranks on other machines in round ``info``."""
        return {}, {}

    def finished(self, final: JobState, failures: list[RankFailure]) -> None:
        """The job has ended here: tell whoever must know, then close the links."""

    def close_rendezvous(self, rendezvous: Rendezvous | None) -> None:
        if rendezvous is not None:
            rendezvous.close(shutdown=True)
