"""``Session``: workers that live across cells, keep their namespaces, and survive failures.

    with elastic_magic.Session(nproc=2) as s:
        s.run("import torch; t = torch.ones(2)", setup=True)
        s.run("t += 1")
        s.gather("t")            # {0: tensor([2., 2.]), 1: tensor([2., 2.])}

A cell runs on every rank in that rank's persistent namespace; its value, output and failure
come back as a job's do (a JobResult). A rank that raises reports it and the session goes
on. A rank that dies (in a cell or between cells), or that does not come back from an
interrupt, breaks the group: before the next cell the session is re-formed (new rendezvous
round, workers from the warm pool, the setup cells replayed in order, an elastic State
restored from its last commit), up to ``max_restarts`` times. Kernel variables do not travel
implicitly: ``push`` sends them. With ``nnodes`` other machines join (``wait_for_join_command``)
and run every cell too; a machine that joins or leaves re-forms the session at the next cell.
``%elastic session start`` is the same from the notebook.
"""

from __future__ import annotations

import atexit
import keyword
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle

from ..agent.handles.handle import (
    AgentThread,
    Renderer,
    agent_error,
    next_batch,
    pause_after,
    wait_through_interrupts,
)
from ..agent.inbox import CellRequest, InboxItem, InterruptCommand
from ..agent.loop.assemble import session_agent
from ..agent.loop.cells import SessionEndedError, session_payload
from ..agent.status import JobStatus
from ..result import JobFailedError, JobResult, JobState
from ..result_parts import Unpicklable
from ..spec import JobSpec, SpecError, options_help
from ..ui.text import TextRenderer
from ..wire.events import Event, JobFinished
from ..wire.messages import ScaleCommand, StopCommand
from ..wire.payload import PayloadError, build_payload
from ..worker import session_cells as worker_session

# A session survives this many broken groups unless max_restarts says otherwise (a job's
# default is 0: a session is meant to outlive mistakes).
SESSION_MAX_RESTARTS = 3

_live: weakref.WeakSet[Session] = weakref.WeakSet()


def _session_spec(nproc: int | str | None, options: dict[str, Any]) -> JobSpec:
    """A session's JobSpec: ``max_restarts`` defaults to 3, and it cannot be detached."""
    options.setdefault("max_restarts", SESSION_MAX_RESTARTS)
    if options.get("detach"):
        raise SpecError("a session cannot be detached: its ranks run the cells this kernel "
                        "sends, one by one, so it ends with the kernel. Run a long training "
                        "as a job: %%elastic --detach (with --bg to go on in the notebook).")
    return JobSpec.create(nproc, **options)


class Session(AgentThread):
    """Workers that stay alive across cells, from now until ``stop`` (or the ``with``'s end).
    Sending a cell (run, push, pull, gather) to an ended session raises SessionEndedError;
    if its agent itself fails meanwhile, AgentError.

    Args:
        nproc: Workers on this machine: N, "auto", "cpu" or "gpu".
        render: Shows each cell's events (also ``.render``). Default: plain text.
        **options: The job's options, as the ``%%elastic`` flags (listed below; an unknown
            one is a TypeError, a bad value a SpecError); ``max_restarts`` defaults to 3.

    Attributes:
        cells: Cells sent so far (push, pull and gather too); ``spec``, ``run_id``: a Job's.
    """

    def __init__(self, nproc: int | str | None = None, *, render: Renderer | None = None,
                 **options: Any) -> None:
        super().__init__(_session_spec(nproc, options), None, hosts=True)
        self.render = render
        self._agent = session_agent(self.spec, self.run_id, self._inbox, self._board,
                                    token=self.token)
        self._lock = threading.Lock()  # one cell at a time from the kernel's threads
        self.cells = 0
        self._thread = threading.Thread(target=self._run, name=f"elastic-session-{self.run_id}",
                                        daemon=True)
        self._thread.start()
        _live.add(self)

    def _answer_unserved(self, item: InboxItem) -> None:
        if isinstance(item, CellRequest) and not item.outcome.done():
            item.outcome.set_exception(self.ended_error())
        else:
            super()._answer_unserved(item)

    # -- cells ----------------------------------------------------------------------------

    def run(self, source: str, *, setup: bool = False, render: Renderer | None = None,
            check: bool = True) -> JobResult:
        """Run ``source`` on every rank, in its namespace. Ctrl-C interrupts every rank's
        code and raises KeyboardInterrupt once they are back (or the session re-formed).

        Args:
            source: The cell's code; its last expression is each rank's value.
            setup: Replay it, in order, whenever the session re-forms.
            render: Shows this cell's events instead of the session's renderer.
            check: Raise JobFailedError if the cell fails (the session goes on).

        Returns:
            The cell's JobResult.

        Raises:
            PayloadError: ``source`` does not compile.
            JobFailedError: The cell failed (with ``check``).
        """
        payload = build_payload(source, self.spec, namespace={})
        return self._submit(session_payload(payload), setup, render, check)

    def push(self, *, setup: bool = False, **values: Any) -> None:
        """Set these variables on every rank (cloudpickled by value).

        Args:
            setup: Push them again whenever the session re-forms.
            **values: Variable name -> value.

        Raises:
            ValueError: A name is not a variable name.
            PayloadError: A value cannot be pickled (nothing is pushed).
        """
        for name in values:
            _check_name(name)
        problems = []
        for name, value in values.items():
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                problems.append(f"  {name} ({type(value).__name__}): {type(exc).__name__}: "
                                f"{exc}")
        if problems:
            raise PayloadError("These values cannot be sent to the workers:\n"
                               + "\n".join(problems) + "\nNothing was pushed.")
        payload = build_payload(worker_session.assign, self.spec, args=(values,))
        self._submit(session_payload(payload), setup, self._quiet, check=True)

    def pull(self, name: str, rank: int = 0) -> Any:
        """The variable ``name`` of one rank.

        Args:
            name: A variable of the ranks' namespaces.
            rank: Whose.

        Returns:
            Its value, unpickled here.

        Raises:
            NameError: The rank has no such variable.
            ValueError: ``name`` is not a variable name, or no rank ``rank`` runs.
            PayloadError: The value cannot be sent back (not picklable).
        """
        return self._fetch(name, rank)[rank]

    def gather(self, name: str) -> dict[int, Any]:
        """The variable ``name`` of every rank (the errors are ``pull``'s).

        Args:
            name: A variable of the ranks' namespaces.

        Returns:
            Rank -> its value.
        """
        return self._fetch(name, None)

    def _fetch(self, name: str, rank: int | None) -> dict[int, Any]:
        _check_name(name)
        payload = build_payload(worker_session.value_of, self.spec, args=(name, rank))
        try:
            result = self._submit(session_payload(payload), False, self._quiet, check=True)
        except JobFailedError as exc:
            failure = exc.result.failure
            if failure is not None and failure.exc_type == "NameError":
                raise NameError(failure.message) from None
            raise
        if rank is not None and rank not in result.values:
            raise ValueError(f"rank {rank}: the session runs ranks 0-{result.world_size - 1}.")
        values = result.values if rank is None else {rank: result.values[rank]}
        bad = {r: v for r, v in values.items() if isinstance(v, Unpicklable)}
        if bad:
            first = next(iter(bad.values()))
            raise PayloadError(f"{name!r} cannot travel back from rank "
                               f"{', '.join(map(str, bad))}: {first.reason}. Pull something "
                               "picklable (a tensor, .state_dict(), a number).")
        return values

    @staticmethod
    def _quiet(events: list[Event]) -> None:
        """push/pull/gather show nothing but their errors (in the exception)."""

    def _submit(self, payload: Any, setup: bool, render: Renderer | None,
                check: bool) -> JobResult:
        with self._lock:
            if self._done.is_set():
                raise self.ended_error()
            request = CellRequest(payload, setup)
            self.cells += 1
            self._inbox.put(request)
            result = self._follow(request, render or self.render or TextRenderer())
        if check and result.state is JobState.FAILED:
            raise JobFailedError(result)
        return result

    def _follow(self, request: CellRequest, render: Renderer) -> JobResult:
        """Render the cell's events until it ends. Ctrl-C interrupts the ranks; the wait
        goes on until they are back, then KeyboardInterrupt is raised."""
        finished = threading.Event()
        request.outcome.add_done_callback(lambda _: finished.set())
        interrupted = wait_through_interrupts(
            lambda: self._render_batch(request, render, finished),
            lambda: self._inbox.put(InterruptCommand()))
        try:
            result = request.outcome.result()
        except SessionEndedError:
            raise
        except BaseException as exc:
            raise agent_error("the session's agent", exc) from exc
        finish = getattr(render, "finish", None)
        if finish is not None:  # a dashboard ends on the result, as a job's
            render([JobFinished(result)])
        if interrupted:
            raise KeyboardInterrupt
        return result

    def _render_batch(self, request: CellRequest, render: Renderer,
                      finished: threading.Event) -> bool:
        started = time.monotonic()
        ended = finished.is_set()  # read first: every event of an ended cell is queued
        if not ended and self._done.is_set() and not request.outcome.done():
            request.outcome.set_exception(self.ended_error())
        batch = next_batch(request.events, wait=not ended)
        render(batch)
        if not ended and batch:  # throttled, but an ended cell returns at once
            pause_after(started, finished.wait)
        return ended

    def ended_error(self) -> SessionEndedError:
        """What a cell sent to an ended session raises.

        Returns:
            A SessionEndedError that says why it ended.
        """
        why = f" ({self.result.summary()})" if self.result is not None else ""
        if self.error is not None:
            why = f" (its agent failed: {self.error!r})"
        return SessionEndedError(f"the session {self.run_id} has ended{why}; start a new "
                                 "one.")

    # -- the session ----------------------------------------------------------------------

    def scale(self, nproc: int, include: Iterable[int] = ()) -> None:
        """Resize to ``nproc`` workers: before the next cell, or at the next State commit
        of the cell that runs (the same re-formation; it does not count as a restart).

        Args:
            nproc: The new number of workers on this machine, within --min-nproc and
                --max-nproc (else SpecError).
            include: Worker slots left out for failing again that may come back.
        """
        self.spec.check_scale(nproc)
        self._inbox.put(ScaleCommand(nproc, include=tuple(include)))

    def stop(self, timeout: float | None = None) -> None:
        """End the session: workers leave (a running cell is interrupted).

        Args:
            timeout: Seconds to wait for its end at most; None waits as long as it takes.
        """
        if not self._done.is_set():
            self._inbox.put(StopCommand("the session was stopped"))
        self._thread.join(timeout)

    @property
    def active(self) -> bool:
        """Whether the session still runs cells."""
        return not self._done.is_set()

    def _status_extra(self, status: JobStatus) -> dict[str, Any]:
        return {"cells": self.cells}

    def interrupt(self) -> None:
        """KeyboardInterrupt in every rank's running cell (what Ctrl-C does)."""
        self._inbox.put(InterruptCommand())

    def stacks(self, timeout: float = 10.0) -> dict[int, str]:
        """Every rank's Python stacks, without stopping anything.

        Args:
            timeout: Seconds to wait for the agent to gather them (then TimeoutError).

        Returns:
            Global rank -> its stacks (all threads), as text.
        """
        return self.request_stacks().result(timeout)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<elastic Session {self.run_id}: {self._board.current.state.value}>"


def _check_name(name: str) -> None:
    """push, pull and gather take variable names; anything else is refused before a cell
    is sent."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{name!r} is not a variable name.")


def stop_all(which: Callable[[Session], bool] = lambda _: True) -> None:
    """End every live session (the kernel exits, or the extension is unloaded), or those
    ``which`` picks."""
    for session in list(_live):
        if which(session):
            session.stop(timeout=30)  # the workers die with the kernel anyway (lifeline)


atexit.register(stop_all)

if Session.__doc__:  # absent under python -OO
    Session.__doc__ += "\n    Options:\n" + options_help() + "\n"
