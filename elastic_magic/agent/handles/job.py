"""A running job as the kernel sees it: the agent thread, its inbox and its events."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ...result import JobResult, JobState
from ...spec import JobSpec
from ...wire.events import Event
from ...wire.messages import ScaleCommand, StopCommand
from ...wire.payload import Payload
from ..loop.assemble import job_agent
from ..machines.joined import JoinedJob
from ..status import JobStatus
from ..weak import weakly
from .handle import (
    RENDER_INTERVAL,
    AgentError,
    AgentThread,
    Renderer,
    agent_error,
    new_run_id,
    next_batch,
    pause_after,
    wait_through_interrupts,
)

__all__ = ["RENDER_INTERVAL", "AgentError", "Job", "Renderer", "new_run_id"]


class Job(AgentThread):
    """Handle on one elastic job. Commands are queued: safe from any thread.

    A ``%%elastic --bg`` cell returns one; ``launch`` makes one and waits for it.

    Args:
        spec: The job's options (``JobSpec.create``).
        payload: What every rank runs (``payload.build_payload``).
        run_id: The job's name. Default: a new ``em-<hex>``.
        joined: This machine joins another's job (``elastic-magic join``) through it.
        forward: Also gets each event (a joined machine's, for the head to show).

    Attributes:
        spec: The job's JobSpec.
        run_id: The job's name, as in ``%elastic`` commands and the log folder.
        token: What other machines show to join (with ``--nnodes``), else None.
        events: The agent's events, in order, until ``wait`` renders them.
        result: The JobResult once the job has ended, else None.
        error: The agent's own failure, if it failed (``wait`` raises AgentError).
    """

    def __init__(self, spec: JobSpec, payload: Payload, run_id: str | None = None, *,
                 joined: JoinedJob | None = None,
                 forward: Callable[[Event], None] | None = None) -> None:
        super().__init__(spec, run_id, hosts=joined is None)
        self.events: queue.Queue[Event] = queue.Queue()
        self._forward = forward  # a joined machine: the events the head shows too
        # Weakly: a cycle among the agent's parts must not keep this job, and its result,
        # for the collector once it has ended.
        self._agent = job_agent(
            spec, payload, self.run_id, weakly(self._emit, None), self._inbox, self._board,
            token=self.token, joined=joined)
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
        """Start the agent (it starts the workers) on a thread of its own.

        Returns:
            This job, to chain ``.wait()``.

        Raises:
            RuntimeError: It was started before.
        """
        self._thread.start()
        return self

    def _status_extra(self, status: JobStatus) -> dict[str, Any]:
        return {"elapsed": f"{status.elapsed:.1f}s"}

    def wait_for_running(self, timeout: float | None = None) -> bool:
        """Block until every rank is in user code.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            True once running; False if the job ended first or the timeout passed.
        """
        status = self._board.wait_for(lambda s: s.state is JobState.RUNNING, timeout)
        return status.state is JobState.RUNNING

    def wait_done(self, timeout: float | None = None) -> bool:
        """Block until the job has ended (without rendering its events).

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            True once ended; False if the timeout passed.
        """
        return self._done.wait(timeout)

    def __repr__(self) -> str:
        if self.done:
            return f"<elastic Job {self.run_id}: {self.state.value}>"
        # A printed handle (a --text --bg cell's Out) does not change: say when it was true.
        return (f"<elastic Job {self.run_id}: {self.state.value} at {time.strftime('%H:%M:%S')}"
                "; a live handle: show it again, or %elastic status, for its state now>")

    def scale(self, nproc: int, immediate: bool = False, include: Iterable[int] = ()) -> None:
        """Resize to ``nproc`` workers on this machine. With an elastic State in the cell the
        resize happens at the next ``commit()`` (no step lost or repeated) unless
        ``immediate``; a job without State is resized at once.

        Args:
            nproc: The new number of workers on this machine.
            immediate: Restart the group at the new size now, from the last commit.
            include: Worker slots left out for failing again that may come back (others
                stay out at every size).

        Raises:
            SpecError: ``nproc`` is outside the job's --min-nproc/--max-nproc bounds.
        """
        self.spec.check_scale(nproc)
        self._inbox.put(ScaleCommand(nproc, immediate, tuple(include)))

    @property
    def last_commit(self) -> dict[str, Any] | None:
        """Step, time and world size of the snapshot the agent holds (None before one)."""
        commit = self._board.current.last_commit
        return dict(commit) if commit else None

    def wait_for_commit(self, step: int, timeout: float | None = None) -> bool:
        """Block until a snapshot of ``step`` or later is committed.

        Args:
            step: The State's step to wait for.
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            True once committed; False if the job ended first or the timeout passed.
        """

        def reached(status: JobStatus) -> bool:
            commit = status.last_commit
            return commit is not None and commit.get("step") is not None \
                and commit["step"] >= step

        status = self._board.wait_for(reached, timeout)
        return reached(status) and not status.done

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """Every rank's current Python stacks (all threads), without stopping anything;
        ranks on other machines too. A rank that cannot answer (stuck in C code that holds
        the GIL) says so.

        Args:
            timeout: Seconds to wait for the agent to gather them.

        Returns:
            Global rank -> its stacks, as text. After the job has ended: the stacks it kept
            of its stuck ranks when it failed by a timeout or a stall (often none).

        Raises:
            TimeoutError: The agent did not gather them in time (try again).
        """
        answer = self.request_stacks()
        try:
            return answer.result(timeout)
        except FutureTimeout:
            if self.done:
                return self._kept_stacks()
            raise TimeoutError(f"{self.run_id}: the agent did not gather the stacks within "
                               f"{timeout:g}s (it may be tearing a group down); try again.") \
                from None

    def stop(self, reason: str = "stopped") -> None:
        """Ask the agent to stop every worker (SIGINT, then SIGTERM, then SIGKILL); returns
        at once (``wait_done`` waits for the end).

        Args:
            reason: Why, as the job's result and panel show it.
        """
        self._inbox.put(StopCommand(reason))

    @property
    def started(self) -> bool:
        """Whether ``start`` was called."""
        return self._thread.ident is not None

    def end(self, reason: str) -> None:
        """Stop the job if it runs and return once it has ended, whatever interrupts
        the wait (a second Ctrl-C must not leave workers behind).

        Args:
            reason: Why, as the job's result and panel show it.
        """
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

        Args:
            render: Takes each batch of events (at most 10 a second; an empty one is a
                tick). None: the events are dropped.

        Returns:
            The JobResult, whatever the job's state (a failed job raises nothing here).

        Raises:
            AgentError: The agent itself failed; the workers were stopped.
            KeyboardInterrupt: Ctrl-C, once the workers have stopped.
        """
        def step() -> bool:
            try:
                return self._render_batch(render)
            except KeyboardInterrupt:
                raise  # the agent escalates to SIGKILL on its own; the wait goes on
            except BaseException:
                self.end("the cell's output failed")
                raise

        interrupted = wait_through_interrupts(step, self._interrupted)
        self._thread.join()
        if self.error is not None:
            raise agent_error("the elastic agent", self.error) from self.error
        if interrupted:
            raise KeyboardInterrupt
        return self._ended_with()

    def _ended_with(self) -> JobResult:
        assert self.result is not None  # the agent ended without error: it left one
        return self.result

    def _interrupted(self) -> None:
        self.stop("interrupted")

    @property
    def interrupt_note(self) -> str:
        """What a Ctrl-C in ``wait`` did, as the notebook says it."""
        return f"job {self.run_id} was stopped; its workers have exited"

    def _render_batch(self, render: Renderer | None) -> bool:
        """Render what arrived within one interval; True once the job has ended."""
        started = time.monotonic()
        batch = next_batch(self.events, wait=True)
        if render is not None:
            render(batch)  # an empty batch is a tick: throttled renderers flush on it
        finished = self.done and self.events.empty()
        if batch and not finished:
            pause_after(started)
        return finished
