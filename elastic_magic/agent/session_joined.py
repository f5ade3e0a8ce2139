"""A session's agent on a machine that joined (``elastic-magic join``): it forms its group
when the head's round does, runs the cells the head sends and reports each; a machine that
joins or leaves re-forms the session at the next cell boundary (the head broadcasts Regroup,
every machine joins the new round). The head counts restarts."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..events import Event
from ..messages import Action, CellReport, InterruptCell, SessionCell, StopCommand
from ..payload import Payload
from ..result import JobResult, JobState, RankFailure
from .ending import close_group, finish
from .hub import FromLink
from .policy import CellStep
from .session import SessionAgent

if TYPE_CHECKING:
    from ..spec import JobSpec
    from .roles import JoinedJob


class JoinedSessionAgent(SessionAgent):
    """A session's agent on a machine that joined the head's session."""

    def __init__(self, *args: Any, forward: Callable[[Event], None],
                 **kwargs: Any) -> None:
        self.forward = forward
        super().__init__(*args, **kwargs)

    def _deliver(self, event: Event) -> None:
        self.forward(event)  # the notebook shows it; nothing is kept here

    def run(self) -> JobResult:
        final = JobState.STOPPED
        try:
            self.rendezvous = self.role.open()
            self._form()
            while self.ended is None:
                item = self.inbox.get()  # idle: blocks
                if isinstance(item, FromLink) and isinstance(item.message, SessionCell):
                    self._run_sent_cell(item.message)
                    continue
                action = self._handle(item)
                if action is Action.STOP:
                    self.ended = JobState.STOPPED
                elif action is Action.REGROUP:
                    self._form()
                elif self.group is not None and self.broken is None and self._died():
                    self._break_idle()
                    self._report(-1, CellStep.BROKEN, self.failures)
            final = self.ended or JobState.STOPPED
        except BaseException:
            final = JobState.FAILED
            raise
        finally:
            self._dismiss()
            result = finish(self, final)
        return result

    def _handle(self, item: Any) -> Action | None:
        if isinstance(item, FromLink) and isinstance(item.message, InterruptCell):
            self.interrupt = self.round is not None \
                and item.message.round_id == self.round.round_id
            return None
        return super()._handle(item)

    def _form(self) -> None:
        """Join the head's next round; start the group; report it up (seq 0)."""
        close_group(self)
        info = self._next_round()
        if info is None:
            self.ended = JobState.STOPPED
            return
        self._start_group(info)
        self.broken = None
        step, failures = self._run_on_group(None)
        self._report(0, step, failures)

    def _run_sent_cell(self, cell: SessionCell) -> None:
        if self.round is None or cell.round_id != self.round.round_id:
            return  # for a round this machine is not in
        if self.broken is not None or self.group is None:
            self._report(cell.seq, CellStep.BROKEN, self.failures)
            return
        here = dataclasses.replace(cell.payload, cwd=self.payload.cwd,
                                   sys_path=self.payload.sys_path)  # this machine's
        step, failures = self._run_on_group(here)
        self._report(cell.seq, step, failures)

    def _report(self, seq: int, step: CellStep, failures: list[RankFailure]) -> None:
        assert self.round is not None
        results = self.group.results() if self.group and step is CellStep.DONE else {}
        self.role.link.send(CellReport(  # type: ignore[attr-defined]
            self.round.round_id, seq, self.round.node_rank, results, failures,
            broken=step is CellStep.BROKEN))

    def _break(self, reason: str, failures: list[RankFailure]) -> None:
        self.failures, self.broken = failures, reason  # the head counts restarts



def join_session(spec: JobSpec, payload: Payload, run_id: str, joined: JoinedJob,
                 forward: Callable[[Event], None]) -> JobState:
    """``elastic-magic join`` for a session: run this machine's part until the head ends
    it (or Ctrl-C / SIGTERM here: the head re-forms without this machine)."""
    from .status import StatusBoard

    inbox: queue.Queue[Any] = queue.Queue()
    agent = JoinedSessionAgent(spec, run_id, inbox, StatusBoard(), joined=joined,
                                  ready=payload, forward=forward)
    outcome: list[JobState] = []
    # Not Thread.join: a KeyboardInterrupt inside it can leave the thread looking ended.
    finished = threading.Event()

    def run() -> None:
        import signal

        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            outcome.append(agent.run().state)
        except BaseException:
            outcome.append(JobState.FAILED)
            raise
        finally:
            finished.set()

    threading.Thread(target=run, name=f"elastic-session-{run_id}", daemon=True).start()
    try:
        finished.wait()
    except KeyboardInterrupt:
        inbox.put(StopCommand("this machine was interrupted"))
        while not finished.is_set():  # until its workers are gone and the head told
            try:
                finished.wait()
            except KeyboardInterrupt:
                continue
        raise
    return outcome[0] if outcome else JobState.FAILED
