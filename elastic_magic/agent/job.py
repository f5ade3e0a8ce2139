"""A running job as the kernel sees it: the agent thread, its inbox and its events."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from ..events import Event
from ..messages import ScaleCommand, StacksCommand, StopCommand
from ..payload import Payload
from ..result import JobResult, JobState
from ..spec import JobSpec
from .hub import new_token
from .roles import JoinedJob
from .status import JobStatus, StatusBoard
from .supervisor import Agent

# Renderers get at most this many updates per second: Jupyter drops IOPub traffic above
# about 1000 messages/s, and each update may resend a widget's whole state.
RENDER_INTERVAL = 0.1

Renderer = Callable[[list[Event]], None]


def new_run_id() -> str:
    return f"em-{uuid.uuid4().hex[:12]}"


class AgentError(RuntimeError):
    """The agent itself failed (not the user's code); workers were stopped."""


def _without_locals(error: BaseException) -> BaseException:
    """``error`` with its frames' variables dropped (the traceback still prints): they
    would keep the agent, its stores and their ports alive as long as the error is kept."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    return error


class AgentThread:
    """What a Job and a Session share: their agent runs on a kernel thread of its own,
    and what it leaves is its result (or its own error), never the agent itself."""

    _agent: Any
    _board: StatusBoard
    _done: threading.Event
    result: JobResult | None
    error: BaseException | None

    def _run(self) -> None:
        # Workers inherit this thread's signal mask until they have left the kernel's
        # process group (setsid): blocked, a Ctrl-C or SIGTERM meant for the kernel cannot
        # kill a worker in that window. Python runs handlers on the main thread anyway.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        assert self._agent is not None
        try:
            self.result = self._agent.run()
        except BaseException as exc:
            self.error = _without_locals(exc)
        finally:
            self._agent = None  # what ended keeps its result, not its payload or stores
            self._done.set()
            self._board.publish(done=True)
            self._answer_late()

    def _answer_late(self) -> None:
        """Commands that came after the agent's last look get an answer."""
        raise NotImplementedError


class Job(AgentThread):
    """Handle on one elastic job. Commands are queued: safe from any thread."""

    def __init__(self, spec: JobSpec, payload: Payload, run_id: str | None = None, *,
                 joined: JoinedJob | None = None,
                 forward: Callable[[Event], None] | None = None) -> None:
        self.spec = spec
        self.run_id = run_id or new_run_id()
        self.events: queue.Queue[Event] = queue.Queue()
        self._inbox: queue.Queue[Any] = queue.Queue()
        # What other machines must show to join (ELASTIC_MAGIC_TOKEN fixes it for scripts).
        self.token = (os.environ.get("ELASTIC_MAGIC_TOKEN") or new_token()) \
            if spec.multi_node and joined is None else None
        self._forward = forward  # a joined machine: the events the head shows too
        self._board = StatusBoard()
        self._agent: Agent | None = Agent(
            spec, payload, self.run_id, self._emit, self._inbox, self._board,
            token=self.token, joined=joined)
        self._done = threading.Event()
        self.result: JobResult | None = None
        self.error: BaseException | None = None
        # Spawning from this long-lived thread matters: PR_SET_PDEATHSIG fires when the
        # spawning *thread* exits.
        self._thread = threading.Thread(
            target=self._run, name=f"elastic-agent-{self.run_id}", daemon=True
        )

    def _emit(self, event: Event) -> None:
        self.events.put(event)
        if self._forward is not None:
            self._forward(event)

    def start(self) -> Job:
        self._thread.start()
        return self

    def _answer_late(self) -> None:
        """Commands that came after the agent's last look: nobody will carry them out, but
        whoever waits for stacks gets an answer (none: no rank runs any more)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, StacksCommand) and not item.answer.done():
                item.answer.set_result({})

    @property
    def status_snapshot(self) -> JobStatus:
        """The job as it stands (immutable; safe from any thread)."""
        return self._board.current

    @property
    def state(self) -> JobState:
        return self._board.current.state

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def log_dir(self) -> Path:
        return self.spec.log_dir / self.run_id

    def wait_for_join_command(self, timeout: float | None = None) -> str | None:
        """The command other machines run to join this job (``--nnodes`` above 1), once its
        rendezvous is open; None for a one-machine job, or if the job ended first."""
        if not self.spec.multi_node:
            return None
        return self._board.wait_for(lambda s: s.join_command is not None, timeout).join_command

    def wait_for_running(self, timeout: float | None = None) -> bool:
        """Block until every rank is in user code; False if the job ended first or the
        timeout passed."""
        status = self._board.wait_for(lambda s: s.state is JobState.RUNNING, timeout)
        return status.state is JobState.RUNNING

    def status(self) -> dict[str, Any]:
        """A snapshot for people: state, size, restarts, elapsed, live worker PIDs."""
        s = self._board.current
        return {
            "run_id": self.run_id,
            "state": s.state.value,
            "world_size": s.world_size,
            "nnodes": s.nnodes,
            "restarts": f"{s.restarts}/{self.spec.max_restarts}",
            "elapsed": f"{s.elapsed:.1f}s",
            "pids": dict(s.pids),
            "log_dir": str(self.log_dir),
        }

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the job has ended (without rendering); False on timeout."""
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        if self.done:
            return f"<elastic Job {self.run_id}: {self.state.value}>"
        # A printed handle (a --text --bg cell's Out) does not change: say when it was true.
        return (f"<elastic Job {self.run_id}: {self.state.value} at {time.strftime('%H:%M:%S')}"
                "; a live handle: show it again, or %elastic status, for its state now>")

    def scale(self, nproc: int, immediate: bool = False) -> None:
        """Resize to ``nproc`` workers on this machine. With an elastic State in the cell the
        resize happens at the next ``commit()`` (no step lost or repeated) unless
        ``immediate``; a job without State is resized at once. Raises SpecError outside the
        job's --min-nproc/--max-nproc bounds."""
        self.spec.check_scale(nproc)
        self._inbox.put(ScaleCommand(nproc, immediate))

    @property
    def last_commit(self) -> dict[str, Any] | None:
        """Step, time and world size of the snapshot the agent holds (None before one)."""
        commit = self._board.current.last_commit
        return dict(commit) if commit else None

    def wait_for_commit(self, step: int, timeout: float | None = None) -> bool:
        """Block until a snapshot of ``step`` or later is committed; False if the job ended
        first or the timeout passed."""

        def reached(status: JobStatus) -> bool:
            commit = status.last_commit
            return commit is not None and commit.get("step") is not None \
                and commit["step"] >= step

        status = self._board.wait_for(reached, timeout)
        return reached(status) and not status.done

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """Every rank's current Python stacks (all threads), by global rank, without
        stopping anything; ranks on other machines too. A rank that cannot answer (stuck in
        C code that holds the GIL) says so. After the job has ended: the stacks it kept of
        its stuck ranks when it failed by a timeout or a stall (often none)."""
        answer = self.request_stacks()
        try:
            return answer.result(timeout)
        except FutureTimeout:
            if self.done:
                return self._kept_stacks()
            raise TimeoutError(f"{self.run_id}: the agent did not gather the stacks within "
                               f"{timeout:g}s (it may be tearing a group down); try again.") \
                from None

    def request_stacks(self) -> Future[dict[int, str]]:
        """:meth:`stacks` without waiting: the future gets them (from the agent thread)."""
        answer: Future[dict[int, str]] = Future()
        if self.done:
            answer.set_result(self._kept_stacks())
        else:
            self._inbox.put(StacksCommand(answer))
        return answer

    def _kept_stacks(self) -> dict[int, str]:
        return dict(self.result.stacks) if self.result is not None else {}

    def stop(self, reason: str = "stopped") -> None:
        """Ask the agent to stop every worker (SIGINT, then SIGTERM, then SIGKILL)."""
        self._inbox.put(StopCommand(reason))

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def end(self, reason: str) -> None:
        """Stop the job if it runs and return once it has ended, whatever interrupts
        the wait (a second Ctrl-C must not leave workers behind)."""
        if not self.started or self.done:
            return
        self.stop(reason)
        while True:
            try:
                self._done.wait()
                return
            except KeyboardInterrupt:
                continue

    def wait(self, render: Renderer | None = None) -> JobResult:
        """Block until the job ends, handing batched events to ``render``.

        Ctrl-C (a kernel interrupt) stops the workers first, then raises KeyboardInterrupt.
        A renderer that raises stops the job too, which then ends before the error is
        raised: nobody would be watching it.
        """
        interrupted = False
        while True:
            try:
                finished = self._render_batch(render)
            except KeyboardInterrupt:
                if not interrupted:
                    interrupted = True
                    self.stop("interrupted")
                continue  # keep waiting: the agent escalates to SIGKILL on its own
            except BaseException:
                self.end("the cell's output failed")
                raise
            if finished:
                break
        self._thread.join()
        if self.error is not None:
            raise AgentError(f"the elastic agent failed: {self.error!r}") from self.error
        if interrupted:
            raise KeyboardInterrupt
        assert self.result is not None
        return self.result

    def _render_batch(self, render: Renderer | None) -> bool:
        """Render what arrived within one interval; True once the job has ended."""
        started = time.monotonic()
        batch: list[Event] = []
        try:
            batch.append(self.events.get(timeout=RENDER_INTERVAL))
            while True:
                batch.append(self.events.get_nowait())
        except queue.Empty:
            pass
        if render is not None:
            render(batch)  # an empty batch is a tick: throttled renderers flush on it
        finished = self.done and self.events.empty()
        if batch and not finished:
            time.sleep(max(0.0, RENDER_INTERVAL - (time.monotonic() - started)))
        return finished

