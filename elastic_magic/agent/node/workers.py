"""Worker processes: spawn fresh interpreters, read their reports, stop them.

The process spawned for a rank is its shepherd (``worker/shepherd.py``), which forks the
worker and outlives everything below it: ``Worker.proc`` is the shepherd, and its exit
means the rank and all it started have ended. How the worker itself ended comes sooner,
on the rank's notice pipe, read with its report pipe's end (``Worker.ended_status``).
Every function here runs on the agent thread, the only thread that polls or signals
these processes, so a PID is never signalled after it was reaped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import select
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ...result import RankFailure
from ...wire.events import EventSink
from ...wire.messages import (
    Commit,
    CommitReply,
    ErrorInfo,
    Exit,
    Handoff,
    Interrupt,
    Reply,
    Result,
    Run,
    StateRequest,
)
from ...wire.protocol import Channel, ProtocolError, widen_pipe
from ...worker.shepherd import END_ALL, NOTICE
from ...worker.stdout import NONCE_BYTES
from .proc import parent_pid, worker_gone

if TYPE_CHECKING:
    from ...logs import RunFolder

from ..inbox import Inbox, WorkerReport
from . import interpreter
from .output import RankPump, new_tail
from .zygote_link import PooledProcess, Zygote

# A report pipe that closed waits this long for its shepherd's word on how the worker
# ended, which comes at once when the worker has (then the rank's end is judged on it).
NOTICE_GRACE = 1.0
# A worker that exited without its report pipe closing (a forked grandchild holds it) is
# judged on its exit code after this long.
CHANNEL_CLOSE_GRACE = 1.0


class WorkerState(str, Enum):
    """torch's vocabulary for a worker (group)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"


@dataclass
class Worker:
    """One rank's worker process, as the agent sees it: its pipes, its reports and the
    notice of its end."""

    local_rank: int
    global_rank: int
    attempt: int
    state: WorkerState = WorkerState.INIT
    proc: subprocess.Popen[bytes] | PooledProcess | None = None
    control: Channel | None = None
    log_dir: Path | None = None
    tail: deque[str] = field(default_factory=new_tail)
    threads: list[threading.Thread] = field(default_factory=list)
    result: Result | None = None
    error: ErrorInfo | None = None
    channel_closed_at: float | None = None
    ended_status: int | None = None  # the worker's wait status, from its shepherd
    reaped_at: float | None = None  # when its shepherd reaped it (told with the status)
    exited_at: float | None = None
    heard_at: float = 0.0  # time.monotonic() of its last report (survivors: progress)
    running: bool = False
    resized: bool = False  # left at a commit that applied a resize
    parked: bool = False  # survivors stay: left its payload, waits for the next Run
    # A session's rank that answered its cell and waits for the next: an error it reported
    # was that cell's, not why it ends now (a kill between cells is a kill).
    idle: bool = False
    slot: int | None = None  # see policy.Membership
    cell_pid: int | None = None  # the process that runs the cell (the shepherd's child)

    def renew(self, attempt: int, rank: int, emit: EventSink) -> None:
        """A survivor joins the group of ``attempt`` as ``rank`` (same process): what it
        reported in the group before is forgotten; its output is of the new attempt, and
        goes to ``emit`` (the new group's sink)."""
        self.attempt, self.global_rank = attempt, rank
        self.state = WorkerState.HEALTHY
        self.result = self.error = None
        self.running = self.resized = self.parked = self.idle = False
        for thread in self.threads:
            if isinstance(thread, RankPump):
                thread.emit, thread.attempt, thread.rank = emit, attempt, rank

    @property
    def pid(self) -> int:
        """The rank's shepherd: the process we spawned, signal and reap."""
        return self.proc.pid if self.proc else -1

    def has_ended(self) -> bool:
        """The rank has ended and every report it sent is recorded: its report pipe has
        closed (reports and the close come in order), or its shepherd exited over a grace
        ago (a forked grandchild may hold the pipe). A shepherd's exit alone is not enough:
        a rank that left at a resize has exited before its Resized report is read."""
        return self.channel_closed_at is not None or (
            self.exited_at is not None and time.time() - self.exited_at > CHANNEL_CLOSE_GRACE)

    @property
    def ended_at(self) -> float | None:
        """When the rank ended: its shepherd's reaping, else its pipe's end (read maybe after
        a teardown its death caused) or its shepherd's exit (a killed shepherd goes first),
        whichever came first: a rank is not stopped by the teardown its own death caused."""
        seen = (self.reaped_at, self.channel_closed_at, self.exited_at)
        return min((t for t in seen if t is not None), default=None)

    def reaped(self) -> bool:
        """Known to have exited; no system call, so safe from any thread."""
        return self.proc is None or self.proc.returncode is not None

    def exit_code(self) -> int | None:
        """The rank's exit code (minus a signal's number), once it has ended: its
        shepherd's, or told by it before it has ended what the worker left."""
        code = self.proc.poll() if self.proc else None
        if code is None and self.ended_status is not None:
            return os.waitstatus_to_exitcode(self.ended_status)
        return code

    def alive(self) -> bool:
        """The rank runs."""
        return self.proc is not None and self.exit_code() is None

    def exited(self) -> bool:
        """Its shepherd has exited: nothing of the rank is left."""
        return self.proc is None or self.proc.poll() is not None

    def process_gone(self) -> bool:
        """The rank's worker process has died though the end of its report pipe may not
        have reached us yet (a kill a moment ago); see ``proc.worker_gone``."""
        return worker_gone(self.pid)

    def send(self, message: Run | Reply | Exit | Interrupt) -> bool:
        """Send on the control pipe; False when the worker has already gone."""
        if self.control is None:
            return False
        try:
            self.control.send(message)
            return True
        except (BrokenPipeError, OSError):
            return False

    def close_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    def failure(self) -> RankFailure:
        """Why this worker failed: its own report, or its exit code or signal."""
        failure = RankFailure(
            rank=self.global_rank, local_rank=self.local_rank, attempt=self.attempt,
            pid=self.pid, log_dir=str(self.log_dir), time=self.ended_at or time.time(),
        )
        if self.error is not None and not self.idle:
            e = self.error
            return dataclasses.replace(
                failure, time=e.time, exc_type=e.exc_type, message=e.message,
                traceback=e.traceback, exit_code=e.exit_code, cell_line=e.cell_line,
                source_line=e.source_line)
        # how the worker ended, as its shepherd told it: the shepherd may since have been
        # stopped by a teardown, which its own exit would report instead
        code = os.waitstatus_to_exitcode(self.ended_status) if self.ended_status is not None \
            else self.exit_code()
        signal_name = _signal_name(-code) if code is not None and code < 0 else None
        failure = dataclasses.replace(failure, exit_code=code, signal=signal_name)
        if code == 0:  # only a session's worker fails so: it should wait for the next cell
            when = "in the middle of the cell" if self.result is None and self.error is None \
                and not self.idle else "between cells"
            failure = dataclasses.replace(failure, reason=f"exited with code 0 {when}")
        return failure


def spawn(
    worker: Worker, *, env: dict[str, str], cwd: str, key: bytes, run_folder: RunFolder,
    inbox: Inbox, emit: EventSink, zygote: Zygote | None = None, spares: int = 0,
) -> None:
    """Start the worker (``python -m elastic_magic.worker``, without the current directory on
    its path: see ``interpreter``) in its own session, or fork it from the
    ``zygote`` of the warm pool (which keeps ``spares`` ready from then on); then its
    pumps and reader."""
    control_r, control_w = os.pipe()
    report_r, report_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    notice_r, notice_w = os.pipe()
    for fd in (control_w, report_w):  # snapshots travel on these
        widen_pipe(fd)
    # The key goes into the pipe before the child exists: a child that dies at once (a
    # kernel interrupt can reach it before it leaves the kernel's process group) must show
    # up as a failed worker, not as a broken pipe in the agent.
    # Then the nonce of the rank's order marks (``worker/stdout.py``): out of the cell's
    # reach, so that nothing the cell prints can pass for a mark.
    nonce = secrets.token_bytes(NONCE_BYTES)
    os.write(control_w, key + nonce)
    try:
        if zygote is not None:
            worker.proc = PooledProcess(zygote, zygote.fork(
                env, cwd, (control_r, report_w, out_w, err_w, notice_w), spares))
        else:
            worker.proc = subprocess.Popen(
                interpreter.command("elastic_magic.worker.__main__", str(control_r),
                                    str(report_w), str(notice_w), str(os.getpid())),
                pass_fds=(control_r, report_w, notice_w),
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                env=env, cwd=cwd,
                start_new_session=True,  # the kernel's Ctrl-C reaches workers only through us
            )
    except BaseException:
        for fd in (control_w, report_r, out_r, err_r, notice_r):
            os.close(fd)
        raise
    finally:
        for fd in (control_r, report_w, out_w, err_w, notice_w):
            os.close(fd)
    worker.state = WorkerState.HEALTHY
    worker.control = Channel(control_w, key)
    worker.log_dir = run_folder.rank_dir(worker.attempt, worker.global_rank)
    try:
        logs = run_folder.create_logs(worker.attempt, worker.global_rank)
    except BaseException:  # the worker is the group's to stop; these are ours to close
        for fd in (report_r, out_r, err_r, notice_r):
            os.close(fd)
        raise
    worker.threads.append(RankPump(
        {"stdout": out_r, "stderr": err_r}, logs, rank=worker.global_rank,
        attempt=worker.attempt, emit=emit, tail=worker.tail, nonce=nonce.hex(),
    ))
    worker.threads.append(threading.Thread(
        target=_read_reports, args=(worker, Channel(report_r, key), notice_r, inbox),
        name=f"elastic-reports-rank{worker.global_rank}", daemon=True,
    ))
    for thread in worker.threads:
        thread.start()


def _read_reports(worker: Worker, channel: Channel, notice: int, inbox: Inbox) -> None:
    try:
        while True:
            try:
                message = channel.recv()
            except (EOFError, ProtocolError, OSError) as exc:
                # EOF marks the moment the worker died (or exited): the failure's time. How
                # it ended follows from its shepherd, told again with it.
                closed = WorkerReport(worker.attempt, worker.local_rank, None, time.time())
                inbox.put(closed)
                if isinstance(exc, EOFError) and (ended := _ended_status(notice)) is not None:
                    inbox.put(dataclasses.replace(closed, ended=ended[0], time=ended[1]))
                return
            inbox.put(WorkerReport(worker.attempt, worker.local_rank, message, time.time()))
    finally:
        channel.close()
        os.close(notice)


def _ended_status(notice: int) -> tuple[int, float] | None:
    """The worker's wait status and when its shepherd reaped it, told once the worker has
    ended; None if not within the grace the agent gives a report pipe (a worker that
    closed it and runs on; a shepherd killed)."""
    if not select.select([notice], [], [], NOTICE_GRACE)[0]:
        return None
    data = os.read(notice, NOTICE.size)
    status, reaped_at = NOTICE.unpack(data) if len(data) == NOTICE.size else (None, 0.0)
    return None if status is None else (status, reaped_at)


def take_memory_file(worker: Worker, request: StateRequest) -> int | Literal[False] | None:
    """The memory file a commit's snapshot is in, now ours; None for a snapshot sent as
    bytes; False when the file cannot be read here (the worker is told to use the pipe)."""
    if not isinstance(request, Commit) or request.handoff is None:
        return None
    memory_file = take_handoff(worker, request.handoff)
    if memory_file is None:
        worker.send(Reply(request.request_id, CommitReply(handoff_failed=True)))
        return False
    return memory_file


def take_handoff(worker: Worker, offer: Handoff) -> int | None:
    """Open the anonymous memory file a worker wrote a snapshot into (its descriptor, seen
    through /proc while the worker waits for our reply): our own descriptor of it, or None
    where it cannot be opened."""
    if parent_pid(offer.pid) != worker.pid:  # the worker is the child of our shepherd
        return None
    try:
        fd = os.open(offer.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_size != offer.size:
        os.close(fd)
        return None
    return fd


# (signal to the shepherd, seconds to wait for its exit before the next step). It relays
# SIGINT and SIGTERM to the worker's process group; on END_ALL it SIGKILLs everything
# below it. SIGKILL is for a shepherd that cannot finish (a descendant in uninterruptible
# sleep), so that a stop always returns; its worker dies with it (PR_SET_PDEATHSIG).
Escalation = tuple[tuple[signal.Signals, float], ...]
INTERRUPT_ESCALATION: Escalation = ((signal.SIGINT, 3.0), (signal.SIGTERM, 3.0),
                                    (END_ALL, 5.0), (signal.SIGKILL, 2.0))
TEARDOWN_ESCALATION: Escalation = ((signal.SIGTERM, 3.0), (END_ALL, 5.0), (signal.SIGKILL, 2.0))


def stop(workers: list[Worker], escalation: Escalation) -> None:
    """Signal each live rank's shepherd, escalating until all have exited: then nothing
    the workers started is left."""
    for sig, grace in escalation:
        live = [w for w in workers if not w.exited()]
        if not live:
            break
        for worker in live:
            with contextlib.suppress(ProcessLookupError):  # not reaped: the PID is ours
                os.kill(worker.pid, sig)
        wait_for_exit(live, grace)
    for worker in workers:
        worker.close_control()


def wait_for_exit(workers: list[Worker], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(w.exited() for w in workers):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)  # a rank that ended: the next group waits for its shepherd here
    return True


def join_threads(workers: list[Worker], timeout: float = 5.0) -> None:
    """Wait for pumps to drain (so no output is lost) and readers to finish."""
    deadline = time.monotonic() + timeout
    for worker in workers:
        for thread in worker.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
