"""The loops without processes: the one-shot job's loop and a session's loop, each driven
through the real engine, with a scripted worker group and a scripted rendezvous given to
the engine's constructor (as torch tests its rendezvous with a fake state holder). What a
worker would report is put on the inbox as a real worker's reader thread would."""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import cloudpickle
import pytest

from elastic_magic.agent.inbox import CellRequest, FromLink, Inbox, WorkerReport
from elastic_magic.agent.loop.cells import CellEvents
from elastic_magic.agent.loop.engine import Engine
from elastic_magic.agent.loop.job_loop import JobLoop
from elastic_magic.agent.loop.session_loop import SessionLoop
from elastic_magic.agent.machines.roles import SingleMachine
from elastic_magic.agent.node.group import WorkerGroup
from elastic_magic.agent.node.workers import Worker, WorkerState
from elastic_magic.agent.round_info import RoundInfo
from elastic_magic.agent.status import StatusBoard
from elastic_magic.result import JobFailedError, JobState
from elastic_magic.spec import JobSpec
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import (
    Excluded,
    Output,
    Restarting,
    SessionBroken,
    SessionReformed,
)
from elastic_magic.wire.link_messages import Regroup
from elastic_magic.wire.messages import (
    Action,
    DumpStacks,
    ErrorInfo,
    Exit,
    Failed,
    Interrupt,
    Resized,
    Result,
    Run,
    Running,
    ScaleCommand,
    Stacks,
    StopCommand,
)
from elastic_magic.wire.payload import Payload

pytestmark = pytest.mark.unit

# -- the scripted world ----------------------------------------------------------------


@dataclass(frozen=True)
class Do:
    """What a scripted worker does with a payload: return ``value``, raise ``raises``, end
    its process with ``exit`` (a code, or -signal), or hang (until interrupted)."""

    value: object = None
    raises: str | None = None
    exit: int | None = None
    hang: bool = False
    then: Callable[[Inbox], None] | None = None  # e.g. the user asks for a resize meanwhile


OK = Do()
Script = Callable[[int, int, Payload], Do]  # (attempt, slot, payload) -> what it does


class FakeProcess:
    """A worker's shepherd, as the group sees it: a pid and, once it ended, a code."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeControl:
    """A worker's control pipe: what the agent sends it makes the script answer."""

    def __init__(self, group: ScriptedGroup, worker: Worker, slot: int) -> None:
        self.group, self.worker, self.slot = group, worker, slot
        self.hanging = False

    def send(self, message: object) -> None:
        group, worker = self.group, self.worker
        if worker.proc is None or worker.proc.returncode is not None:
            raise BrokenPipeError
        match message:
            case Run(payload):
                group.world.ran.append((worker.attempt, self.slot, payload.source))
                self._do(group.world.script(worker.attempt, self.slot, payload), payload)
            case Interrupt() if self.hanging:
                self.hanging = False
                self._report(Failed(_error("KeyboardInterrupt")))
            case Exit():
                self._end(0)
            case DumpStacks(request_id):
                self._report(Stacks(request_id, ()))

    def close(self) -> None:
        pass

    def _do(self, do: Do, payload: Payload) -> None:
        self._report(Running(time.time(), os.getpid()))
        if do.then is not None:
            do.then(self.group.inbox)
        if do.exit is not None:
            self._end(do.exit)
        elif do.raises is not None:
            self._report(Failed(_error(do.raises)))
            if not payload.session:
                self._end(1)
        elif do.hang:
            self.hanging = True
        else:
            self._report(Result(cloudpickle.dumps(do.value)))
        if payload.session and do.exit is None and not do.hang:
            for stream in ("stdout", "stderr"):  # the end of the cell, as the pump reads it
                self.group.emit(Output(self.worker.global_rank, stream, (),
                                       self.worker.attempt, cell_end=True))

    def _report(self, message: object) -> None:
        worker = self.worker
        self.group.inbox.put(WorkerReport(worker.attempt, worker.local_rank, message,
                                          time.time()))

    def _end(self, code: int) -> None:
        """The process ends: its report pipe closes (None), as a dead worker's does."""
        assert self.worker.proc is not None
        if self.worker.proc.returncode is None:
            self.worker.proc.returncode = code
            self._report(None)


def _error(exc_type: str) -> ErrorInfo:
    return ErrorInfo(exc_type, f"{exc_type} in the script", "", time.time(), 1)


class ScriptedGroup(WorkerGroup):
    """A WorkerGroup whose workers are scripted: it starts no process and signals none;
    everything else (what it records, polls and reports) is the real group's."""

    world: World
    inbox: Inbox

    def start(self, payload, env_for, *, cwd, key, run_folder, inbox, emit, pool=True,
              preload=(), stay=False, slots=None, survivors=None):
        self.persistent = payload.session
        self.inbox, self.emit = inbox, emit
        slots = [int(env_for(w)["ELASTIC_MAGIC_SLOT"]) for w in self.workers]
        self.world.slots.append(slots)
        for worker, slot in zip(self.workers, slots, strict=True):
            worker.proc = FakeProcess(1000 * (self.attempt + 1) + worker.local_rank)
            worker.state = WorkerState.HEALTHY
            worker.control = FakeControl(self, worker, slot)
            worker.send(Run(payload))

    def _stop(self, escalation) -> None:  # SIGTERM (or SIGINT) reaches every live worker
        self.world.on_teardown(self.attempt, self.inbox)
        for worker in self.workers:
            if worker.control is not None and worker.alive():
                worker.control._end(-15)
            if worker.state is not WorkerState.SUCCEEDED:
                worker.state = WorkerState.STOPPED

    def release(self) -> None:
        for worker in self.workers:
            worker.send(Exit())

    def close(self, spare=()) -> None:
        assert not spare, "the scripted jobs run without --survivors: no worker is kept"
        self._stop(None)


class FakeRendezvous:
    """Every round completes at once, with this machine alone; a stop asked for first
    ends the wait (None)."""

    endpoint = "127.0.0.1:0"

    def __init__(self) -> None:
        self.rounds = 0
        self.closed = False

    def next_round_unless(self, nproc, stop, interval, *, cancel):
        if stop():
            return None
        self.rounds += 1
        return RoundInfo(self.rounds, f"round-{self.rounds}", 0, 1, 0, nproc, "127.0.0.1", 1)

    def check(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def close(self, shutdown: bool = True) -> None:
        self.closed = True


class ScriptedMachine(SingleMachine):
    def open(self):
        self.rendezvous = FakeRendezvous()
        return self.rendezvous


@dataclass
class World:
    """One test's scripted machine: what its workers do, and what they were given."""

    script: Script
    on_teardown: Callable[[int, Inbox], None] = lambda attempt, inbox: None
    slots: list[list[int]] = field(default_factory=list)  # each attempt's worker slots
    ran: list[tuple[int, int, str | None]] = field(default_factory=list)
    events: list = field(default_factory=list)
    role: type[SingleMachine] = ScriptedMachine

    def engine(self, spec: JobSpec, payload: Payload, emit=None, inbox=None) -> Engine:
        """The real engine, with this world's group and rendezvous."""
        emit = emit or self.events.append
        inbox = inbox or queue.Queue()
        role = self.role(spec, "em-test", emit)

        class Group(ScriptedGroup):
            world = self

        return Engine(spec, payload, "em-test", emit, inbox, StatusBoard(), role,
                      new_group=Group)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def spec(tmp_path, nproc: int = 2, **options) -> JobSpec:
    return JobSpec.create(nproc, log_dir=tmp_path, pool=False, **options)


def run_job(world: World, spec: JobSpec):
    started = time.monotonic()
    engine = world.engine(spec, Payload(source="job"))
    result = JobLoop(engine).run()
    # no wait on a timeout (monitor, rendezvous, grace: 5 s or more); not a speed check,
    # which a loaded machine would fail (2 s seen in a clean-clone run)
    assert time.monotonic() - started < 4.0
    return result, engine


# -- the one-shot loop -------------------------------------------------------------------


def test_a_failure_restarts_the_group_and_is_counted(tmp_path):
    world = World(lambda attempt, slot, _: Do(raises="ValueError")
                  if attempt == 0 and slot == 1 else Do(value=slot))
    result, engine = run_job(world, spec(tmp_path, max_restarts=2))
    assert result.state is JobState.SUCCEEDED and result.values == {0: 0, 1: 1}
    assert result.restarts == 1 and len(world.of(Restarting)) == 1
    assert world.slots == [[0, 1], [0, 1]]
    assert engine.rendezvous is None and engine.group is None  # released
    # Its ranks never used State: the timeline says why the cell runs from its start again.
    (restart,) = world.of(Restarting)
    assert restart.no_state
    headline = describe(restart)
    assert headline is not None and headline.text.endswith(
        "after rank 1: ValueError: ValueError in the script; the cell keeps no "
        "elastic_magic.State (nor a trainer's integration): every rank runs it again from "
        "its start")


def test_restarts_run_out(tmp_path):
    world = World(lambda attempt, slot, _: Do(exit=3) if slot == 1 else Do(hang=True))
    result, _ = run_job(world, spec(tmp_path, max_restarts=1))
    assert result.state is JobState.FAILED and result.restarts == 1
    assert result.failure.rank == 1 and result.failure.exit_code == 3
    assert result.failure.attempt == 1  # the last attempt's failure, not the first's
    assert "attempt 2 of 2" in str(JobFailedError(result))
    assert len(world.slots) == 2


def test_a_stop_heard_while_a_failed_group_is_torn_down_ends_the_job_unrestarted(tmp_path):
    def stop_meanwhile(attempt: int, inbox: Inbox) -> None:
        inbox.put(StopCommand("the user stopped it"))

    world = World(lambda attempt, slot, _: Do(raises="ValueError") if slot == 1
                  else Do(hang=True), on_teardown=stop_meanwhile)
    result, _ = run_job(world, spec(tmp_path, max_restarts=3))
    assert result.state is JobState.STOPPED and result.restarts == 0
    assert result.stop_reason == "the user stopped it" and len(world.slots) == 1


def test_a_resize_is_a_new_round_not_a_restart(tmp_path):
    def scale(inbox: Inbox) -> None:
        inbox.put(ScaleCommand(3))  # from a widget, while the group runs

    world = World(lambda attempt, slot, _: Do(hang=True, then=scale)
                  if attempt == 0 and slot == 0 else Do(hang=True) if attempt == 0
                  else Do(value=slot))
    result, _ = run_job(world, spec(tmp_path, max_nproc=3, max_restarts=0))
    assert result.state is JobState.SUCCEEDED and result.values == {0: 0, 1: 1, 2: 2}
    assert result.restarts == 0 and result.resizes == 1 and result.world_size == 3
    assert world.slots == [[0, 1], [0, 1, 2]]


class FollowingMachine(ScriptedMachine):
    """As a joined machine does: a Regroup from the head ends its group."""

    def handle(self, item, group, server, world_size):
        return Action.REGROUP if isinstance(item.message, Regroup) else None


def test_a_regroup_for_a_group_this_machine_has_left_does_not_break_its_next_round(tmp_path):
    """The head's Regroup as it left round 1 reached a joined machine only once that was in
    round 2 (a loaded machine: it had joined that round meanwhile). It broke round 2, whose
    new round then waited for the finished machines' rendezvous heartbeats to expire (a
    full run's flake of ``test_launchers``). A Regroup names its group's round: the one for
    this machine's round regroups it, an older one is ignored."""

    def regroup(round_id: str) -> Callable[[Inbox], None]:
        return lambda inbox: inbox.put(FromLink(None, 0, Regroup(round_id)))  # type: ignore

    world = World(lambda attempt, slot, _: Do(hang=True, then=regroup("round-1"))
                  if attempt == 0 else Do(value=attempt, then=regroup("round-1"))
                  if attempt == 1 else Do(value=attempt), role=FollowingMachine)
    result, _ = run_job(world, spec(tmp_path, 1, max_restarts=0))
    assert result.state is JobState.SUCCEEDED and result.restarts == 0
    assert result.values == {0: 1}  # round 2's group ran to its end
    assert world.slots == [[0], [0]]


def test_a_regroup_for_the_round_a_machine_is_entering_ends_that_rounds_group(tmp_path):
    """The head regrouped round 2 while this loaded machine was still leaving its
    rendezvous (its round was still 1): the Regroup waits for round 2's group and ends it,
    or the machine's ranks would wait for peers the head has already torn down."""

    def regroup(round_id: str) -> Callable[[int, Inbox], None]:
        return lambda attempt, inbox: inbox.put(
            FromLink(None, 0, Regroup(round_id))) if attempt == 0 else None  # type: ignore

    world = World(lambda attempt, slot, _: Do(exit=3) if attempt == 0
                  else Do(value=attempt), on_teardown=regroup("round-2"),
                  role=FollowingMachine)
    result, _ = run_job(world, spec(tmp_path, 1, max_restarts=1))
    assert result.state is JobState.SUCCEEDED and result.values == {0: 2}
    assert world.slots == [[0], [0], [0]]  # round 2's group was ended: round 3 ran


def test_a_rank_that_died_before_the_teardown_is_its_cause_though_its_end_was_read_after():
    """Rank 1 killed itself (SIGTERM); rank 0's barrier failed with "Connection reset by
    peer" and the agent tore the group down before it had read rank 1's report pipe's end
    (a loaded machine: a full run's flake of test_descendants). Rank 1 is dated by when
    its shepherd reaped it, before the teardown: the root cause, not a rank it stopped."""
    group = WorkerGroup(0, 0, 2)
    for worker in group.workers:
        worker.proc = FakeProcess(100 + worker.local_rank)
        worker.state = WorkerState.HEALTHY
    teardown_at = time.time()
    group.record(WorkerReport(0, 0, Failed(ErrorInfo(
        "RuntimeError", "[pair.cc:537] Read error: Connection reset by peer", "",
        teardown_at - 0.2, 4)), teardown_at - 0.2))
    group.workers[1].proc.returncode = -signal.SIGTERM  # type: ignore[union-attr]
    group.record(WorkerReport(0, 1, None, teardown_at + 0.3))  # read after the teardown
    group.record(WorkerReport(0, 1, None, teardown_at - 0.25, ended=signal.SIGTERM))
    rank_1, rank_0 = group.failures_before(teardown_at)
    assert (rank_1.rank, rank_1.signal) == (1, "SIGTERM")
    assert rank_0.rank == 0 and rank_0.exc_type == "RuntimeError"


@pytest.mark.parametrize("last_report", ["Resized", "none"])
def test_a_clean_exit_counts_only_once_every_report_of_the_rank_is_read(last_report):
    """A rank that leaves at a commit for a resize sends Resized and exits 0; its shepherd's
    exit can be seen before the report pipe is read (a full loop's flake of
    test_lost_machines: the job ended "succeeded" after 5 of its 40 steps). The exit is
    judged once the pipe's end is read: a resize, or, with no result, success."""
    group = WorkerGroup(0, 0, 1)
    worker = group.workers[0]
    worker.proc = FakeProcess(100)
    worker.state = WorkerState.HEALTHY
    worker.proc.returncode = 0  # type: ignore[union-attr]
    status = group.poll()
    assert not (status.succeeded or status.resized or status.failed)
    if last_report == "Resized":
        group.record(WorkerReport(0, 0, Resized(5, time.time()), time.time()))
    group.record(WorkerReport(0, 0, None, time.time()))  # the pipe's end
    status = group.poll()
    assert (status.resized, status.succeeded) == (last_report == "Resized",
                                                  last_report == "none")
    assert not status.failed


def _slot_1_fails_twice(scales: list[ScaleCommand]) -> Script:
    """Slot 1 fails in the first two attempts; in the third, a scale is asked for (each of
    ``scales``, one per attempt), and the last attempt succeeds."""

    def script(attempt: int, slot: int, _: Payload) -> Do:
        if attempt < 2:
            return Do(exit=3) if slot == 1 else Do(hang=True)
        if attempt - 2 < len(scales):
            command = scales[attempt - 2]
            return Do(hang=True, then=(lambda inbox: inbox.put(command)) if slot == 0
                      else None)
        return Do(value=slot)

    return script


def test_a_slot_that_fails_again_is_left_out_and_stays_out_when_the_job_grows(tmp_path):
    world = World(_slot_1_fails_twice([ScaleCommand(3)]))
    result, engine = run_job(world, spec(tmp_path, 3, min_nproc=2, max_restarts=3))
    assert result.state is JobState.SUCCEEDED
    assert world.slots == [[0, 1, 2], [0, 1, 2], [0, 2], [0, 2, 3]]
    assert result.restarts == 1  # the exclusion was no restart; neither was the resize
    (excluded,) = world.of(Excluded)
    assert excluded.what == "slot 1 of this machine" and excluded.goes_on
    assert result.excluded == [f"slot 1 of this machine: {excluded.why}"]
    assert "failed again after a restart" in excluded.why and "code 3" in excluded.why
    assert engine.board.current.excluded == (result.excluded[0],)


def test_the_cells_own_error_at_a_new_size_fails_the_job_and_leaves_out_no_slot(tmp_path):
    """Lightning's "devices=2 does not match the world size (3)" after a scale to 3: an
    exception of the cell's code on every attempt is no evidence against a slot. It used
    to leave slot 0 out ("failed again after a restart") and report success at 2 ranks."""

    def scale(inbox: Inbox) -> None:
        inbox.put(ScaleCommand(3))

    def script(attempt: int, slot: int, _: Payload) -> Do:
        if attempt == 0:
            return Do(hang=True, then=scale if slot == 0 else None)
        return Do(raises="MisconfigurationException") if slot == 0 else Do(hang=True)

    world = World(script)
    result, _ = run_job(world, spec(tmp_path, min_nproc=1, max_nproc=3, max_restarts=2))
    assert result.state is JobState.FAILED and result.world_size == 3
    assert result.failure is not None
    assert result.failure.exc_type == "MisconfigurationException"
    assert result.restarts == 2 and result.excluded == [] and not world.of(Excluded)
    assert world.slots == [[0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2]]


def test_a_slot_left_out_comes_back_when_the_user_names_it(tmp_path):
    world = World(_slot_1_fails_twice([ScaleCommand(3, include=(1,))]))
    result, _ = run_job(world, spec(tmp_path, 3, min_nproc=2, max_restarts=3))
    assert result.state is JobState.SUCCEEDED and result.values == {0: 0, 1: 1, 2: 2}
    assert world.slots[-1] == [0, 1, 2] and result.excluded == []


# -- a session's loop --------------------------------------------------------------------


class Session:
    """A SessionLoop on a thread of its own, fed cells as the kernel's Session feeds it."""

    def __init__(self, world: World, spec: JobSpec) -> None:
        self.inbox: Inbox = queue.Queue()
        events = CellEvents(self.inbox)
        self.engine = world.engine(spec, Payload(source="ready", session=True), events.route,
                                   self.inbox)
        self.loop = SessionLoop(self.engine, events)
        self.final: list = []
        self.thread = threading.Thread(target=lambda: self.final.append(self.loop.run()))
        self.thread.start()

    def run(self, source: str, setup: bool = False):
        request = CellRequest(Payload(source=source, session=True), setup)
        self.inbox.put(request)
        result = request.outcome.result(timeout=5)
        events = []
        while not request.events.empty():
            events.append(request.events.get())
        return result, events

    def stop(self):
        self.inbox.put(StopCommand("the session was stopped"))
        self.thread.join(timeout=5)
        return self.final[0]


def test_a_session_re_forms_after_its_group_broke_and_replays_its_setup_cells(tmp_path):
    def script(attempt: int, slot: int, payload: Payload) -> Do:
        if payload.source == "kill rank 1" and slot == 1:
            return Do(exit=-9)
        return Do(hang=True) if payload.source == "kill rank 1" else Do(value=payload.source)

    world = World(script)
    started = time.monotonic()
    session = Session(world, spec(tmp_path, max_restarts=3))
    assert session.run("setup", setup=True)[0].state is JobState.SUCCEEDED
    broken, events = session.run("kill rank 1")
    assert broken.state is JobState.FAILED and broken.failure.rank == 1
    assert broken.failure.signal == "SIGKILL" and broken.restarts == 1
    (why,) = [e for e in events if isinstance(e, SessionBroken)]
    assert why.reason == "rank 1 was killed by SIGKILL in the cell" and why.reforms
    again, events = session.run("after")
    assert again.state is JobState.SUCCEEDED and again.values == {0: "after", 1: "after"}
    assert [e.setup_cells for e in events if isinstance(e, SessionReformed)] == [1]
    # the second group: the ready payload, the setup cell replayed, then the cell
    assert [source for attempt, slot, source in world.ran if attempt == 1 and slot == 0] \
        == ["ready", "setup", "after"]
    assert session.stop().state is JobState.STOPPED
    assert time.monotonic() - started < 1.0


def test_a_session_leaves_out_a_slot_that_fails_again_and_keeps_it_out_at_a_resize(tmp_path):
    def script(attempt: int, slot: int, payload: Payload) -> Do:
        if payload.source == "kill slot 1":
            return Do(exit=-9) if slot == 1 else Do(hang=True)
        return Do(value=slot)

    world = World(script)
    started = time.monotonic()
    session = Session(world, spec(tmp_path, 3, min_nproc=2, max_restarts=3))
    assert session.run("kill slot 1")[0].restarts == 1  # a first failure: a restart
    second, _ = session.run("kill slot 1")  # again: left out, which is no restart
    assert second.state is JobState.FAILED and second.restarts == 1
    assert second.excluded[0].startswith("slot 1 of this machine: failed again after a")
    after, _ = session.run("values")
    assert after.values == {0: 0, 1: 2} and world.slots[-1] == [0, 2]
    assert after.excluded[0].startswith("slot 1 of this machine: failed again")
    session.inbox.put(ScaleCommand(3))  # growing again does not bring slot 1 back
    assert session.run("values")[0].values == {0: 0, 1: 2, 2: 3}
    assert world.slots[-1] == [0, 2, 3]
    assert session.engine.board.current.excluded == tuple(after.excluded)  # its status
    session.inbox.put(ScaleCommand(3, include=(1,)))  # unless the user names it back
    assert session.run("values")[0].values == {0: 0, 1: 1, 2: 2}
    assert session.stop().excluded == []
    assert time.monotonic() - started < 1.0
