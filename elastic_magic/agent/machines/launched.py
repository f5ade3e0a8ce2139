"""The machines a head's ``--launcher`` asks the scheduler for, and those it gives back.

The head owns one per job (``Head.launched``): it starts the launchers' Cluster once the
rendezvous accepts machines, knows which hub connection runs in which allocation (each
machine says so in its Hello), and keeps the machines that leave at the next commit (given
back by a scale, or asked by the scheduler's SIGTERM) until they are gone, when their
allocations are cancelled. The launchers' code is imported only where one is used."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ...events import EventSink, MachinesChanged
from ...messages import ReleaseCommand
from ...spec import JobSpec
from ..inbox import Inbox

if TYPE_CHECKING:
    from ...launchers.cluster import Cluster


class Launched:
    def __init__(self, spec: JobSpec, run_id: str, inbox: Inbox, emit: EventSink) -> None:
        self.spec = spec
        self.emit = emit
        self.run_id = run_id
        self.inbox = inbox
        self.cluster: Cluster | None = None
        # where the allocations are shown (the job's status board, set by the assembly)
        self.publish: Callable[[tuple[str, ...]], None] = lambda lines: None
        self.allocations: dict[int, str] = {}  # hub connection -> its allocation
        self.released: dict[int, str] = {}  # connections leaving at a commit -> why
        self._due = False  # the group leaves at its next commit for them

    def start(self, endpoint: str, token: str) -> None:
        if self.spec.launcher is None:
            return
        from ...launchers.cluster import start_cluster
        self.cluster = start_cluster(self.spec, endpoint, token, self.run_id, self._show,
                                     self._from_launcher)

    def _show(self, lines: tuple[str, ...]) -> None:
        """In the job's status and, as a line, in the dashboard and the text output (from
        the launcher's thread: both take events from any thread, as the output pumps do)."""
        self.publish(lines)
        self.emit(MachinesChanged(lines))

    def _from_launcher(self, allocation: str) -> None:
        """The launcher's thread gives a running machine back: through the agent's inbox."""
        self.inbox.put(ReleaseCommand(allocation, "given back to the scheduler (scale)"))

    def scale(self, nnodes: int) -> None:
        if self.cluster is not None:
            self.cluster.scale(nnodes - 1)  # the head is one of them

    def nodes_in(self, allocation: str) -> list[int]:
        return [node for node, held in self.allocations.items() if held == allocation]

    def mark(self, node: int, reason: str) -> None:
        self.released[node] = reason
        self._due = True

    def take_due(self) -> bool:
        due, self._due = self._due, False
        return due

    def gone(self, node: int) -> str:
        """A machine given back has left: its allocation is cancelled; why it went."""
        self.cancel(self.allocations.pop(node, ""))
        return self.released.pop(node)

    def cancel(self, allocation: str) -> None:
        if self.cluster is not None and allocation:
            self.cluster.cancel_later(allocation)

    def close(self) -> None:
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()
