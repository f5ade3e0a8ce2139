"""What a Job and a Session handle share: their agent runs on a kernel thread of its own;
commands reach it through one inbox (safe from any thread); the kernel reads its state from
a status board, and waits for it in throttled batches of events that a Ctrl-C does not
cut short."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ...checks import SpecError
from ...result import JobResult, JobState
from ...spec import JobSpec
from ...stacks import drop_locals
from ...wire.events import Event
from ...wire.messages import StacksCommand
from ..inbox import Inbox, InboxItem
from ..machines.head import Head
from ..machines.hub import new_token
from ..status import JobStatus, StatusBoard

if TYPE_CHECKING:
    from ..loop.engine import Engine

# Renderers get at most this many updates per second: Jupyter drops IOPub traffic above
# about 1000 messages/s, and each update may resend a widget's whole state.
RENDER_INTERVAL = 0.1

Renderer = Callable[[list[Event]], None]


def new_run_id() -> str:
    return f"em-{uuid.uuid4().hex[:12]}"


def agent_error(what: str, error: BaseException) -> AgentError:
    """The agent's own failure as the notebook shows it: a refused folder says what to do,
    anything else is a bug of ours, shown with its type."""
    from ...folders import NotPrivate

    if isinstance(error, NotPrivate):
        return AgentError(f"{what}: {error}")
    return AgentError(f"{what} failed: {error!r}")


class AgentError(RuntimeError):
    """The agent itself failed (not the user's code); workers were stopped."""


class Loop(Protocol):
    """An agent's loop (a job's, a session's): it runs until the job ends."""

    engine: Engine

    def run(self) -> JobResult: ...


class AgentThread:
    """A Job's or a Session's handle on its agent, which runs on a thread of its own; what
    the agent leaves is its result (or its own error), never the agent itself."""

    _agent: Loop | None
    _thread: threading.Thread
    link_lost = False  # an attached job's link to its own agent failed (AttachedJob)

    def __init__(self, spec: JobSpec, run_id: str | None, *, hosts: bool) -> None:
        """``hosts``: this machine hosts the job (others join it, with the token)."""
        self.spec = spec
        self.run_id = run_id or new_run_id()
        # What other machines must show to join (ELASTIC_MAGIC_TOKEN fixes it for scripts).
        self.token = (os.environ.get("ELASTIC_MAGIC_TOKEN") or new_token()) \
            if spec.multi_node and hosts else None
        self._inbox: Inbox = queue.Queue()
        self._board = StatusBoard()
        self._done = threading.Event()
        self.result: JobResult | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        # Workers inherit this thread's signal mask until they have left the kernel's
        # process group (setsid): blocked, a Ctrl-C or SIGTERM meant for the kernel cannot
        # kill a worker in that window. Python runs handlers on the main thread anyway.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        assert self._agent is not None
        try:
            self.result = self._agent.run()
        except BaseException as exc:
            drop_locals(exc)  # its frames would keep the agent, its stores and ports alive
            self.error = exc
        finally:
            self._agent = None  # what ended keeps its result, not its payload or stores
            self._done.set()
            self._board.publish(done=True)
            self._answer_late()

    def _answer_late(self) -> None:
        """Commands that came after the agent's last look: nobody will carry them out, but
        whoever waits for an answer gets one."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._answer_unserved(item)

    def _answer_unserved(self, item: InboxItem) -> None:
        if isinstance(item, StacksCommand) and not item.answer.done():
            item.answer.set_result({})  # no rank runs any more

    # -- what the kernel reads ------------------------------------------------------------

    @property
    def status_snapshot(self) -> JobStatus:
        """As it stands (immutable; safe from any thread): what the panel shows."""
        return self._board.current

    @property
    def state(self) -> JobState:
        """What the job is doing now (``JobState``)."""
        return self._board.current.state

    @property
    def done(self) -> bool:
        """Whether the agent has ended (``result`` or ``error`` is set)."""
        return self._done.is_set()

    @property
    def log_dir(self) -> Path:
        """Its ranks' logs: ``group_<n>/rank_<r>/{stdout,stderr}.log``. Once ended, where
        the run's folder really is (someone may have renamed it in a shared --log-dir and
        planted another at its name: the job kept writing into its own)."""
        if self.result is not None:
            return self.result.log_dir
        return self.spec.log_dir / self.run_id

    def status(self) -> dict[str, Any]:
        """A snapshot for people: state, size, restarts, what was left out and why, live
        worker PIDs, logs.

        Returns:
            ``run_id``, ``state``, ``world_size``, ``nnodes``, ``restarts`` ("n/max"),
            ``pids`` (rank -> the PID of the process that runs its cell on this machine,
            once it runs: its ``os.getpid()``, for kill, py-spy or top), ``log_dir``; a
            job's ``elapsed``, a session's ``cells``; ``excluded`` and ``machines`` when
            there are any.
        """
        s = self._board.current
        excluded = {"excluded": "; ".join(s.excluded)} if s.excluded else {}
        if s.machines:  # a --launcher's allocations, pending ones with the scheduler's reason
            excluded["machines"] = "; ".join(s.machines)
        return {"run_id": self.run_id, "state": s.state.value, "world_size": s.world_size,
                "nnodes": s.nnodes, "restarts": f"{s.restarts}/{self.spec.max_restarts}",
                **self._status_extra(s), **excluded, "pids": dict(s.pids),
                "log_dir": str(self.log_dir)}

    def _status_extra(self, status: JobStatus) -> dict[str, Any]:
        return {}

    def scale_nodes(self, nnodes: int) -> None:
        """Ask the job's --launcher for ``nnodes`` machines in all, this one included: more
        are submitted to the scheduler; fewer give machines back (pending allocations first,
        then the newest): its join is told to leave (SIGTERM, or its ssh stdin closed), the
        others regroup from the last commit, and its allocation ends. Asked before the
        job reaches its scheduler (not started yet, the rendezvous not open), it is kept:
        the launcher then asks for that many.

        Args:
            nnodes: The number of machines, within the job's ``--nnodes MIN:MAX``.

        Raises:
            SpecError: The job has no --launcher, or ``nnodes`` is outside MIN:MAX.
            ValueError: The job has ended.
        """
        self._check_nodes(nnodes)
        self._ask_for_machines(nnodes)

    def _ask_for_machines(self, nnodes: int) -> None:
        agent = self._agent  # the launcher's target is thread-safe to move
        if agent is None:  # it ended (or is ending): nothing will ask for machines
            raise ValueError(f"{self.run_id} has already ended.")
        role = agent.engine.role
        if not isinstance(role, Head):  # cannot be: a job with --launcher hosts the others
            raise SpecError(f"scale --nodes: {self.run_id} does not host its machines.")
        role.launched.scale(nnodes)

    def _check_nodes(self, nnodes: int) -> None:
        if self.spec.launcher is None:
            raise SpecError("scale --nodes needs a job started with --launcher (slurm, ssh); "
                            "without one, machines join and leave with elastic-magic join.")
        if not self.spec.min_nodes <= nnodes <= self.spec.max_nodes:
            raise SpecError(f"scale --nodes {nnodes}: this job runs between "
                            f"{self.spec.min_nodes} and {self.spec.max_nodes} machines "
                            "(--nnodes MIN:MAX).")

    def wait_for_join_command(self, timeout: float | None = None) -> str | None:
        """The command other machines run to join (``--nnodes`` above 1), once the
        rendezvous accepts them.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            The ``elastic-magic join ...`` command line; None on one machine, if the job
            ended first or the timeout passed.
        """
        if not self.spec.multi_node:
            return None
        return self._board.wait_for(lambda s: s.join_command is not None, timeout).join_command

    def request_stacks(self) -> Future[dict[int, str]]:
        """Every rank's Python stacks, without waiting for them.

        Returns:
            A future that gets global rank -> stacks (from the agent thread). Once ended:
            the stacks it kept of stuck ranks (often none).
        """
        answer: Future[dict[int, str]] = Future()
        if self.done:
            answer.set_result(self._kept_stacks())
        else:
            self._inbox.put(StacksCommand(answer))
        return answer

    def _kept_stacks(self) -> dict[int, str]:
        return dict(self.result.stacks) if self.result is not None else {}


def next_batch(events: queue.Queue[Event], *, wait: bool) -> list[Event]:
    """The events that arrive within one render interval (only those queued already when
    not ``wait``)."""
    batch: list[Event] = []
    try:
        if wait:
            batch.append(events.get(timeout=RENDER_INTERVAL))
        while True:
            batch.append(events.get_nowait())
    except queue.Empty:
        pass
    return batch


def pause_after(started: float, sleep: Callable[[float], Any] = time.sleep) -> None:
    """Throttle: the rest of the render interval that began at ``started``."""
    sleep(max(0.0, RENDER_INTERVAL - (time.monotonic() - started)))


def wait_through_interrupts(step: Callable[[], bool], on_interrupt: Callable[[], None]) -> bool:
    """Call ``step`` until it says the wait is over. Ctrl-C does not end the wait: the first
    one calls ``on_interrupt`` (which asks the agent to stop or interrupt the ranks), and
    the wait goes on until they are back. True when there was one."""
    interrupted = False
    while True:
        try:
            if step():
                return interrupted
        except KeyboardInterrupt:
            if not interrupted:
                interrupted = True
                on_interrupt()
