"""How an agent is put together: its role (one machine, the head, a machine that joined), an
engine for its worker groups, and the loop that drives them (a one-shot job's, a session's
on the kernel's machine, a session's on a joined machine). The handles (``Job``,
``Session``, ``elastic-magic join``) build their agents here; tests build theirs from the
same parts with a scripted group and rendezvous."""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable

from ...result import JobState
from ...spec import JobSpec
from ...wire.events import Event, EventSink
from ...wire.messages import StopCommand
from ...wire.metrics import MetricsKept
from ...wire.payload import Payload, build_payload
from ...worker import session_cells as worker_session
from ..inbox import Inbox
from ..machines.head import Head
from ..machines.joined import JoinedJob, JoinedMachine
from ..machines.roles import SingleMachine
from ..status import StatusBoard
from .cells import CellEvents, session_payload
from .engine import Engine
from .job_loop import JobLoop
from .session_joined import JoinedSessionLoop
from .session_loop import SessionLoop


def role_for(spec: JobSpec, run_id: str, emit: EventSink, inbox: Inbox,
             payload: Payload, *, token: str | None, joined: JoinedJob | None,
             board: StatusBoard | None = None) -> SingleMachine:
    """This agent's role: a machine that joined, the head of several, or one alone."""
    if joined is not None:
        return JoinedMachine(spec, run_id, emit, joined, inbox)
    if spec.multi_node:
        assert token is not None
        head = Head(spec, run_id, emit, token=token, payload=payload, inbox=inbox)
        if board is not None:  # a launcher's allocations show in the job's status
            head.launched.publish = lambda lines: board.publish(machines=lines)
        return head
    return SingleMachine(spec, run_id, emit)


def job_agent(spec: JobSpec, payload: Payload, run_id: str, emit: EventSink, inbox: Inbox,
              board: StatusBoard, *, token: str | None = None,
              joined: JoinedJob | None = None) -> JobLoop:
    """A one-shot job's agent."""
    metrics = MetricsKept()  # what the ranks logged, for the result
    emit = metrics.tap(emit)
    role = role_for(spec, run_id, emit, inbox, payload, token=token, joined=joined,
                    board=board)
    return JobLoop(_engine(Engine(spec, payload, run_id, emit, inbox, board, role), metrics))


def _engine(engine: Engine, metrics: MetricsKept) -> Engine:
    """The role asks the engine whether its group commits State: a machine given back
    then leaves at the next commit rather than at once. Asked through a weak reference:
    the engine holds its role, and a cycle would keep a finished job for the collector.
    The result's series are those ``metrics`` saw on the sink both were given."""
    engine.metrics = metrics
    ref = weakref.ref(engine)

    def graceful() -> bool:
        alive = ref()
        return alive is not None and alive.graceful

    engine.role.graceful = graceful
    return engine


def ready_payload(spec: JobSpec) -> Payload:
    """What a session's group runs first: every rank is up once it answers."""
    return session_payload(build_payload(worker_session.assign, spec, args=({},)))


def session_agent(spec: JobSpec, run_id: str, inbox: Inbox, board: StatusBoard, *,
                  token: str | None = None) -> SessionLoop:
    """A session's agent in the kernel (alone, or the head of several machines)."""
    events = CellEvents(inbox)
    ready = ready_payload(spec)
    metrics = MetricsKept()  # what each cell's ranks logged, for its result
    emit = metrics.tap(events.route)
    role = role_for(spec, run_id, emit, inbox, ready, token=token, joined=None, board=board)
    return SessionLoop(_engine(Engine(spec, ready, run_id, emit, inbox, board, role), metrics),
                       events)


def join_session(spec: JobSpec, payload: Payload, run_id: str, joined: JoinedJob,
                 forward: Callable[[Event], None]) -> JobState:
    """``elastic-magic join`` for a session: run this machine's part until the head ends
    it (or Ctrl-C / SIGTERM here: the head re-forms without this machine)."""
    inbox: Inbox = Inbox()
    events = CellEvents(inbox, forward)
    role = role_for(spec, run_id, events.route, inbox, payload, token=None, joined=joined)
    loop = JoinedSessionLoop(Engine(spec, payload, run_id, events.route, inbox,
                                    StatusBoard(), role))
    outcome: list[JobState] = []
    # Not Thread.join: a KeyboardInterrupt inside it can leave the thread looking ended.
    finished = threading.Event()

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            outcome.append(loop.run().state)
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
