"""The machines a head's ``--launcher`` asks the scheduler for, and those it gives back.

The head owns one per job (``Head.launched``): it starts the launchers' Cluster once the
rendezvous accepts machines, knows which hub connection runs in which allocation (each
machine says so in its Hello), and keeps the machines that leave at the next commit (given
back by a scale, or asked by the scheduler's SIGTERM) until they are gone, when their
allocations are cancelled. A scale asked before the Cluster starts (before the rendezvous
accepts machines) is kept: the Cluster starts with that many. The launchers' code is
imported only where one is used."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...spec import JobSpec
from ...wire.events import EventSink, MachinesChanged
from .rendezvous import agent_name

if TYPE_CHECKING:
    from ...launchers.cluster import Cluster


class Launched:
    """The head's side of its launcher: the Cluster of allocations it starts, which hub
    connection runs in which allocation, and the machines given back at the next commit."""

    def __init__(self, spec: JobSpec, run_id: str, emit: EventSink,
                 give_back: Callable[[str], None]) -> None:
        self.spec = spec
        self.emit = emit
        self.give_back = give_back  # the head's: a running machine leaves at a commit
        self.run_id = run_id
        self.cluster: Cluster | None = None
        # where the allocations are shown (the job's status board, set by the assembly)
        self.publish: Callable[[tuple[str, ...]], None] = lambda lines: None
        self.allocations: dict[int, str] = {}  # hub connection -> its allocation
        self.started_in: dict[int, str] = {}  # the same, kept after it ended (for names)
        self.released: dict[int, str] = {}  # connections leaving at a commit -> why
        self.agents: dict[tuple[str, int], int] = {}  # (address, agent pid) -> connection
        self._due = False  # the group leaves at its next commit for them
        self.machines = spec.max_nodes - 1  # what the Cluster keeps (the head not counted)
        self._lock = threading.Lock()  # scale (the kernel's thread) against start

    def start(self, endpoint: str, token: str) -> None:
        if self.spec.launcher is None:
            return
        from ...launchers.cluster import start_cluster
        with self._lock:
            self.cluster = start_cluster(self.spec, endpoint, token, self.run_id,
                                         self._show, self.give_back, self.machines)

    def _show(self, lines: tuple[str, ...]) -> None:
        """In the job's status and, as a line, in the dashboard and the text output (from
        the launcher's thread: both take events from any thread, as the output pumps do)."""
        self.publish(lines)
        self.emit(MachinesChanged(lines))

    def scale(self, nnodes: int) -> None:
        with self._lock:
            self.machines = nnodes - 1  # the head is one of them
            if self.cluster is not None:
                self.cluster.scale(self.machines)

    def arrived(self, node: int, allocation: str, agent: tuple[str, int]) -> None:
        """A machine said Hello from ``allocation`` (empty: started by hand), its agent
        running as ``agent`` (address, pid)."""
        self.allocations[node] = allocation
        if allocation:
            self.started_in[node] = allocation
        self.agents[agent] = node  # last: a round that finds it finds its allocation
        cluster = self.cluster
        if cluster is not None and allocation:
            cluster.joined(allocation)

    def sent_away(self, allocation: str) -> str | None:
        """Why a machine that says Hello from ``allocation`` is not let in, if it is not:
        the allocation was given back (its cancel unconfirmed, say, so it started after
        all). The job never counts it; its cancel is asked again, now that it runs."""
        cluster = self.cluster
        if cluster is None or not allocation or not cluster.given_back(allocation):
            return None
        cluster.cancel_later(allocation)
        return f"its allocation {allocation} was given back before it came up"

    def name(self, node: int, host: str) -> str:
        """How the job's timeline names a machine: its address, and the allocation it runs
        in (machines a launcher started on one host share the address)."""
        allocation = self.started_in.get(node)
        return f"{host} ({allocation})" if allocation else host

    def label(self, host: str, pid: int) -> str:
        """How a round names a machine (the charts' line per machine, the same in every
        round): the head as such; one a launcher started by its allocation; one joined by
        hand as its agent (several may share an address). Asked on the rendezvous's thread."""
        allocation = self.started_in.get(self.agents.get((host, pid), -1))
        if allocation:
            return f"{host} ({allocation})"
        if pid == os.getpid() and host == self.spec.rdzv_host:
            return f"{host} (head)"
        return agent_name(host, pid)

    def link_ended(self, node: int) -> None:
        """A machine's link ended, after all it said: its allocation, if that has ended,
        may now be replaced (unless the job's end took it)."""
        allocation = self.allocations.pop(node, "")
        cluster = self.cluster
        if cluster is not None and allocation:
            cluster.left(allocation)

    def ending(self) -> None:
        """The job is over: its machines leave, and none is asked for or replaced."""
        cluster = self.cluster
        if cluster is not None:
            cluster.ending()

    def nodes_in(self, allocation: str) -> list[int]:
        """(From any thread: the dict is copied at once, under the GIL.)"""
        return [node for node, held in list(self.allocations.items()) if held == allocation]

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
