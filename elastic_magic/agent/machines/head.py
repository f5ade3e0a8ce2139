"""The head of a multi-node job: the kernel's agent when other machines join (by hand with
``elastic-magic join``, or started by a ``--launcher``). It hosts the rendezvous and the hub,
serves the other machines' State requests, collects their results, and turns what they say
(Hello, leaving, lost, given back) into the loop's actions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...result import JobState, RankFailure
from ...spec import JobSpec
from ...wire.events import AcceptingNodes, EventSink, Excluded, NodeConnected, Output
from ...wire.link_messages import (
    EndJob,
    GroupResult,
    Hello,
    JobOffer,
    LeaveAtCommit,
    Leaving,
    LinkMessage,
    NodeFinished,
    NodeRequest,
    RankEvents,
    Regroup,
    ReleaseAtCommit,
    StacksRequest,
)
from ...wire.messages import Action, Commit, Result
from ..inbox import FromLink, Inbox
from ..node.group import WorkerGroup
from ..node.network import choose
from ..node.snapshots import StateServer
from ..policy import GroupOutcome
from ..round_info import RoundInfo
from ..weak import weakly
from .hub import HUB_KEY, Hub
from .launched import Launched
from .remote_state import HeadCopies, answer_node
from .rendezvous import Rendezvous, rendezvous_key
from .roles import NextAction, SingleMachine
from .token_file import TokenFile

if TYPE_CHECKING:
    from ...wire.payload import Payload

GIVEN_BACK = "given back to the scheduler (scale)"


def let_in_waiting(rendezvous: Rendezvous, sent_away: dict[int, tuple[str, int]],
                   names: dict[int, str], pids: dict[int, int]) -> bool:
    """Whether a machine the head let in waits for the next round (torch's signal to
    regroup). A machine sent away is no reason: its join may reach torch's wait list after
    ``Head._out_of_rounds`` took it out (it joins as it says Hello), and it is taken out
    again here. Nor is one whose Hello has not come: the check after it regroups."""
    if rendezvous.num_nodes_waiting() == 0:  # the common answer: one store read
        return False
    waiting = rendezvous.waiting_agents()
    for host, pid in set(sent_away.values()) & waiting:
        rendezvous.remove_node(host, pid)
    return any((names.get(node), pid) in waiting for node, pid in pids.items())


class Head(SingleMachine):
    """The kernel of a multi-node job: hosts the rendezvous and a hub that other machines
    join with the token; serves their State requests and collects their results."""

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink, *, token: str,
                 payload: Payload, inbox: Inbox) -> None:
        super().__init__(spec, run_id, emit)
        self.token = token
        self.rdzv_key = rendezvous_key(token)  # the machines that join hold the token too
        self.payload = payload
        self.inbox = inbox
        self.hub: Hub | None = None
        self.names: dict[int, str] = {}  # hub connection -> the machine's address
        self.pids: dict[int, int] = {}  # hub connection -> its agent's pid
        self.greeted: set[int] = set()  # hub connections that said Hello
        self.sent_away: dict[int, tuple[str, int]] = {}  # connection -> (address, pid)
        self.rendezvous: Rendezvous | None = None
        self.results: dict[str, dict[int, GroupResult]] = {}  # round id -> node rank
        # what a --launcher started for the job, and gives back
        self.launched = Launched(spec, run_id, emit, weakly(self._give_back, None))
        self.copies = HeadCopies()  # our ranks' chunks, on another machine
        self.token_file: TokenFile | None = None  # what the join command names

    def open(self) -> Rendezvous:
        self.network = choose(self.spec.rdzv_host, self.spec.env)
        rendezvous = super().open()
        offer = JobOffer(self.run_id, self.spec, self.payload)
        try:  # (the token file goes in finished, as the hub does)
            self.hub = Hub(self.spec.rdzv_host, self.token, offer, self.inbox)
            rendezvous.publish(HUB_KEY, self.hub.address)
            self.token_file = TokenFile(self.run_id, self.token)
            self.join_command = self.token_file.command(rendezvous.endpoint)
            self.emit(self.network)
            self.emit(AcceptingNodes(rendezvous.endpoint, self.join_command))
            self.rendezvous, rendezvous.name_machine = rendezvous, self.launched.label
            rendezvous.close_rounds_when_joined(weakly(self._joining, None))
            self.launched.start(rendezvous.endpoint, self.token)
        except BaseException:
            self.close_rendezvous(rendezvous)
            raise
        return rendezvous

    def _joining(self) -> set[tuple[str, int]] | None:
        """Whom a round waits for: every machine linked here but those leaving, as (address,
        agent pid); None while one has not said who it is (its Hello is on its way). Asked
        on the rendezvous's thread: it reads copies (each one atomic under the GIL)."""
        hub = self.hub
        linked = hub.linked() if hub is not None else set()
        names, pids, leaving = dict(self.names), dict(self.pids), set(self.launched.released)
        if linked - self.greeted:
            return None
        return {(names[n], pid) for n, pid in pids.items() if n in names and n not in leaving}

    def handle(self, item: FromLink, group: WorkerGroup | None, server: StateServer | None,
               world_size: int) -> Action | None:
        if item.message is None and self.hub is not None:  # what it was sending stops
            self.hub.chunks.drop(item.node)
        if item.message is None:  # the machine is gone: its allocation may be replaced
            self.launched.link_ended(item.node)
        match item.message:
            case Hello(host, nproc, pid, allocation) if (
                    why := self.launched.sent_away(allocation)):
                self.greeted.add(item.node)  # no round waits for it
                self.sent_away[item.node] = (host, pid)
                assert self.hub is not None
                self.hub.send_to(item.node, EndJob(why))
                self.emit(NodeConnected(host, nproc, False, why))
                return self._out_of_rounds(item.node)
            case Hello(host, nproc, pid, allocation):
                # named before a round may count it (rounds wait for the greeted)
                self.launched.arrived(item.node, allocation, (host, pid))
                self.names[item.node], self.pids[item.node] = host, pid
                self.greeted.add(item.node)
                self.emit(NodeConnected(self.launched.name(item.node, host), nproc, True))
            case message if message is not None and item.node in self.sent_away:
                return None  # not the job's (its leaving, as a cancel's SIGTERM comes)
            case RankEvents(event):  # its ranks' output belongs to our current attempt here
                attempt = group.attempt if group else 0
                self.emit(dataclasses.replace(event, attempt=attempt)
                          if isinstance(event, Output) else event)
            case NodeRequest() as request:
                assert server is not None and self.hub is not None
                answer_node(self.hub.chunks, item.link, item.node, request, server,
                            world_size)
            case GroupResult() as result:
                self.results.setdefault(result.round_id, {})[result.node_rank] = result
            case NodeFinished(JobState.FAILED, failures) if failures:
                # That machine has no restarts left: the others go on without it if allowed.
                why = f"its workers failed with no restart left ({failures[0].headline})"
                return self._lost(item.node, why, group, failures)
            case NodeFinished() if item.node in self.launched.released:  # left at a commit
                return self._gone_at_commit(item.node)
            case NodeFinished(final):  # the job is over for it: not a loss
                self.pids.pop(item.node, None)
                if final is JobState.SUCCEEDED:  # for every machine: none is replaced
                    self.launched.ending()
            case LeaveAtCommit(reason):  # its scheduler's SIGTERM: preempted or cancelled
                return self._leave_at_commit(item.node, reason, group)
            case Leaving():  # its ranks are about to go: regroup without them
                self.pids.pop(item.node, None)
                self._left(item.node)
                return Action.REGROUP
            case Regroup():  # its group failed: its ranks' peers lose them, here too
                return Action.REGROUP
            case None if item.node in self.pids:  # no Leaving: the machine is lost
                why = item.reason or "its link closed without notice (its agent was killed " \
                    "or crashed)"
                return self._lost(item.node, why, group)
            case None if item.node in self.sent_away:  # it went (nor is it waiting now)
                return self._out_of_rounds(item.node, gone=True)
            case None:
                self._left(item.node, item.link.peer, item.reason)
        return None

    def _out_of_rounds(self, node: int, gone: bool = False) -> Action | None:
        """A machine sent away may have joined torch's rendezvous before it heard: out of
        it (from a round it completed: the others regroup without it)."""
        host, pid = self.sent_away.pop(node) if gone else self.sent_away[node]
        rendezvous = self.rendezvous
        node_rank = rendezvous.remove_node(host, pid) if rendezvous else None
        return Action.REGROUP if node_rank is not None else None

    def _lost(self, node: int, why: str, group: WorkerGroup | None,
              failures: list[RankFailure] | None = None) -> Action | None:
        """A machine is gone for good: out of torch's rendezvous now (no wait for its
        heartbeat there to expire); the others regroup without it while the job's bounds
        allow, else the job fails with it as the root cause."""
        host, pid = self.names.pop(node, "?"), self.pids.pop(node, 0)
        rendezvous = self.rendezvous
        node_rank = rendezvous.remove_node(host, pid) if rendezvous else None
        name = self.launched.name(node, host)
        if node_rank is None and not failures:
            self.emit(NodeConnected(name, 0, False, why))  # it was in no group yet
            return None
        what = f"machine {name}" + (f" (node {node_rank})" if node_rank is not None else "")
        goes_on = 1 + len(self.pids) >= self.spec.min_nodes
        self.emit(Excluded(what, why, goes_on))
        if goes_on:
            self.excluded.append(f"{what}: {why}")
            return Action.REGROUP
        sizes = rendezvous.sizes if rendezvous else []
        first_rank = sum(sizes[:node_rank]) if node_rank is not None \
            and node_rank < len(sizes) else -1
        self.node_failures += failures or [RankFailure(
            rank=first_rank, local_rank=0, attempt=group.attempt if group else 0, pid=pid,
            time=time.time(), reason=f"{what} was lost: {why}")]
        return Action.NODE_FAILED

    def _leave_at_commit(self, node: int, reason: str, group: WorkerGroup | None
                         ) -> Action | None:
        """Below --nnodes MIN without it, the job fails now, naming why it goes;
        otherwise it is told to leave at the next commit, and the group leaves there."""
        staying = [n for n in self.pids if n != node and n not in self.launched.released]
        if 1 + len(staying) < self.spec.min_nodes and node in self.pids:
            return self._lost(node, f"it is leaving: {reason}", group)
        self.launched.mark(node, reason)
        if self.hub is not None:
            self.hub.send_to(node, ReleaseAtCommit(reason))
        # Without State (or before the group runs) no commit comes: re-form now.
        return None if self.graceful() or not self.launched.take_due() else Action.REGROUP

    def _give_back(self, allocation: str) -> None:
        """The launcher's thread gives a running machine back: to the agent's inbox, as
        if the machine had asked to leave at the next commit."""
        hub = self.hub
        for node in self.launched.nodes_in(allocation):
            link = hub.links.get(node) if hub is not None else None
            if link is not None:
                self.inbox.put(FromLink(link, node, LeaveAtCommit(GIVEN_BACK)))
                return
        self.launched.cancel(allocation)  # not in the job (yet): nothing to wait for

    def take_release(self) -> bool:
        return self.launched.take_due()

    def copy_chunk(self, commit: Commit, memory_file: int | None,
                   server: StateServer) -> None:
        links = dict(self.hub.links) if self.hub is not None else {}
        self.copies.copy({n: link for n, link in links.items() if n in self.pids}, commit,
                         memory_file, server.store.parts)

    def _gone_at_commit(self, node: int) -> Action | None:
        """A machine given back has left: out of the rendezvous, its allocation ended."""
        host, pid = self.names.pop(node, "?"), self.pids.pop(node, 0)
        reason = self.launched.gone(node)
        node_rank = self.rendezvous.remove_node(host, pid) if self.rendezvous else None
        self.emit(NodeConnected(self.launched.name(node, host), 0, False,
                                f"left at a commit: {reason}"))
        return Action.REGROUP if node_rank is not None else None

    def _left(self, node: int, peer: str = "", reason: str | None = None) -> None:
        """A machine left; one whose link failed is reported even if it never said hello."""
        if node in self.names or reason:
            name = self.launched.name(node, self.names.pop(node, peer))
            self.emit(NodeConnected(name, 0, False, reason or ""))

    def nodes_waiting(self, rendezvous: Rendezvous) -> bool:
        return let_in_waiting(rendezvous, self.sent_away, self.names, self.pids)  # loop thread

    def stopping_job(self, reason: str) -> None:
        self.launched.ending()  # before its machines go: none of them is replaced
        # Other machines hear first, so their ranks stop rather than fail on lost peers.
        self.broadcast(EndJob(reason))

    def regrouping(self, info: RoundInfo | None) -> None:
        # Their ranks lose peers now: a membership change there too, not a failure.
        if self.hub is not None and info is not None:
            self.hub.broadcast(Regroup(info.round_id))

    reforming = regrouping

    def finish_round(self, info: RoundInfo, group: WorkerGroup,
                     next_action: NextAction) -> GroupOutcome:
        """Wait for every other machine's results of this round."""
        return await_results(lambda: len(self.results.get(info.round_id, {})),
                             info.nnodes - 1, self.spec.timeout, self.spec.monitor_interval,
                             next_action)

    def peers_for_stacks(self) -> set[int]:
        return set(self.names) if self.hub is not None else set()

    def ask_peers_for_stacks(self, request_id: int) -> None:
        self.broadcast(StacksRequest(request_id))

    def broadcast(self, message: LinkMessage) -> None:
        if self.hub is not None:
            self.hub.broadcast(message)

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
        if self.token_file is not None:
            self.token_file.remove()
        self.copies.close()
        try:
            if hub is not None:
                try:
                    hub.broadcast(EndJob(f"the job {final.value}"))
                finally:
                    hub.close()
        finally:
            self.launched.close()  # its machines heard EndJob: now their allocations go


def await_results(reported: Callable[[], int], machines: int, timeout: float,
                  interval: float, next_action: NextAction) -> GroupOutcome:
    """Serve the inbox until ``reported()`` machines' results of a round reach ``machines``;
    a stop, a failure for good or a machine gone before its results end the wait."""
    deadline = time.monotonic() + timeout
    while reported() < machines:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other machines did not report their results within "
                               f"{timeout:.0f}s")
        action = next_action(interval)
        if action is Action.STOP:
            return GroupOutcome.STOP
        if action is Action.NODE_FAILED:
            return GroupOutcome.NODE_FAILED
        if action is Action.REGROUP:  # a machine went before its results came
            return GroupOutcome.REGROUP  # so re-form, and finish from the last commit
    return GroupOutcome.SUCCEEDED
