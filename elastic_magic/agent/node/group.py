"""A WorkerGroup: one attempt's workers on this machine, as the loop sees them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import cloudpickle

from ...result import RankFailure, root_cause_order
from ...wire.events import EventSink, RanksRunning
from ...wire.messages import (
    Commit,
    CommitIntent,
    CommitTarget,
    Exit,
    Failed,
    Imported,
    Parked,
    Resized,
    Result,
    Run,
    Running,
    StateGet,
    StateRequest,
)
from ...wire.payload import Payload
from ..inbox import Inbox
from ..policy import GroupStatus
from .pool import warm_pool
from .workers import (
    CHANNEL_CLOSE_GRACE,
    INTERRUPT_ESCALATION,
    NOTICE_GRACE,
    TEARDOWN_ESCALATION,
    Escalation,
    Worker,
    WorkerReport,
    WorkerState,
    join_threads,
    spawn,
    stop,
    wait_for_exit,
)
from .zygote_link import PoolError

if TYPE_CHECKING:
    from ...logs import RunFolder

_EXIT_AFTER_RESULTS_TIMEOUT = 30.0


class WorkerGroup:
    """One attempt's workers on this machine. It reports what happened (``record``,
    ``poll``) and carries out what the loop decides (``tear_down``, ``interrupt``,
    ``release``); it decides nothing itself."""

    def __init__(self, attempt: int, base_rank: int, nproc: int) -> None:
        self.attempt = attempt
        self.workers = [Worker(local_rank=i, global_rank=base_rank + i, attempt=attempt)
                        for i in range(nproc)]
        # A session's workers wait for the next payload: one that exits has died, whatever
        # its code (a one-shot worker that exits with code 0 has finished).
        self.persistent = False
        self.stay = False  # survivors stay: ranks park instead of exiting (node/survivors)
        self.sharded = False  # a rank committed its part of a sharded State
        self.running_told = False  # RanksRunning was emitted (once a group)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(w.global_rank for w in self.workers)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(w.pid for w in self.workers)

    def live_pids(self) -> dict[int, int]:
        """Rank -> its shepherd, while it lives (what we signal and reap)."""
        return {w.global_rank: w.pid for w in self.workers if not w.reaped()}

    def cell_pids(self) -> dict[int, int]:
        """Rank -> the process that runs its cell, once it runs: ``os.getpid()`` there,
        the one people give kill, py-spy and top."""
        return {w.global_rank: w.cell_pid for w in self.workers
                if w.cell_pid is not None and not w.reaped()}

    def processes(self) -> dict[str, dict[int, int]]:
        """The status board's view of them: ``pids`` (the cells') and ``shepherds``."""
        return {"pids": self.cell_pids(), "shepherds": self.live_pids()}

    def running_news(self) -> RanksRunning | None:
        """Once every rank runs its cell (once a group): the event that names them."""
        if not self.running or self.running_told:
            return None
        self.running_told = True  # each ran (its cell_pid), even one that ended since
        return RanksRunning(self.attempt, self.ranks,
                            tuple(w.cell_pid or 0 for w in self.workers))

    def start(self, payload: Payload, env_for: Callable[[Worker], dict[str, str]], *,
              cwd: str, key: bytes, run_folder: RunFolder, inbox: Inbox, emit: EventSink,
              pool: bool = True, preload: tuple[str, ...] = (), stay: bool = False,
              slots: list[int] | None = None, survivors: dict[int, Worker] | None = None
              ) -> None:
        """Spawn every worker (``env_for(worker)`` gives its environment), from the warm
        pool unless ``pool`` is off (``preload``: modules the job names for it), and send
        it the payload. ``stay``: survivors stay (``node/survivors.py``); a parked
        survivor of the group before, in ``survivors`` by slot, takes its slot again (it is
        taken out of ``survivors``) and runs the payload again: a job's under whatever rank
        the round gives it (the cell runs from the top), a session's only with its own (its
        namespace was made as that rank)."""
        self.persistent, self.stay = payload.session, stay
        for worker, slot in zip(self.workers, slots or range(len(self.workers)), strict=False):
            worker.slot = slot
        kept = survivors if survivors is not None else {}
        for i, worker in enumerate(self.workers):
            old = kept.get(worker.slot) if worker.slot is not None else None
            if old is not None and (old.global_rank == worker.global_rank
                                    or not payload.session):
                del kept[old.slot]  # type: ignore[arg-type]
                old.renew(self.attempt, worker.global_rank, emit)
                old.local_rank, self.workers[i] = worker.local_rank, old
        envs = [env_for(worker) for worker in self.workers]
        for worker, env in zip(self.workers, envs, strict=True):
            if worker.proc is not None:  # a survivor: its new group's variables
                worker.send(Run(payload, stay=stay, env=env))
        fresh = [(w, env) for w, env in zip(self.workers, envs, strict=True) if w.proc is None]
        zygote = None
        if pool and fresh:
            with contextlib.suppress(PoolError):  # then fresh interpreters, as without one
                zygote = warm_pool().zygote_for(fresh[0][1], cwd, payload.sys_path, preload)
        for worker, env in fresh:
            try:
                spawn(worker, env=env, cwd=cwd, key=key, run_folder=run_folder, inbox=inbox,
                      emit=emit, zygote=zygote, spares=len(self.workers))
            except PoolError:
                zygote = None  # it stopped answering: the rest start fresh
                spawn(worker, env=env, cwd=cwd, key=key, run_folder=run_folder, inbox=inbox,
                      emit=emit)
            worker.send(Run(payload, stay=stay))

    def record(self, report: WorkerReport) -> StateRequest | None:
        """Take in one report of this attempt; a State request is returned to be served."""
        if report.attempt != self.attempt:
            return None
        worker = self.workers[report.local_rank]
        worker.heard_at = time.monotonic()
        match report.message:
            case None if report.ended is not None:  # how, and when its shepherd reaped it
                worker.ended_status, worker.reaped_at = report.ended, report.time
            case None:
                worker.channel_closed_at = report.time
            case Running(pid=pid):
                worker.running, worker.cell_pid = True, pid
            case Result() as result:
                worker.result = result
                worker.state = WorkerState.SUCCEEDED
                worker.parked = self.persistent  # a session's rank waits for the next cell
            case Failed(error):
                worker.error = error
                worker.state = WorkerState.FAILED
                worker.parked = self.persistent
            case Resized():
                worker.resized = True
                worker.state = WorkerState.STOPPED
            case Parked():
                worker.parked = True
            case Imported(modules):  # the pool preloads them for the next cells
                warm_pool().learn(modules)
            case StateGet() | Commit() | CommitIntent() | CommitTarget() as request:
                self.sharded |= isinstance(request, Commit) and request.parts > 1
                return request
            case other:
                raise TypeError(f"unexpected message from a worker: {other!r}")
        return None

    @property
    def running(self) -> bool:
        """Every worker has reached user code."""
        return all(w.running for w in self.workers)

    def poll(self) -> GroupStatus:
        """Look at exits, then say where the group stands."""
        self._note_exits()
        return GroupStatus(
            failed=any(self._has_failed(w) for w in self.workers),
            succeeded=all(w.state is WorkerState.SUCCEEDED for w in self.workers),
            resized=all(w.resized for w in self.workers),
            running=self.running,
        )

    def _note_exits(self) -> None:
        now = time.time()
        for worker in self.workers:
            code = worker.exit_code()
            if code is None:
                continue
            if worker.exited_at is None:
                worker.exited_at = now
            # Exited cleanly without a result (os._exit(0) in the cell): success, no value;
            # told only once every report it sent is read (one that left at a resize exits
            # before its Resized is read: it would end the job as done).
            if code == 0 and not self.persistent and worker.state is WorkerState.HEALTHY \
                    and worker.result is None and not worker.resized and worker.has_ended():
                worker.result = Result(cloudpickle.dumps(None))
                worker.state = WorkerState.SUCCEEDED

    def _exit_failed(self, worker: Worker) -> bool:
        """The rank's process has exited, and that is a failure: a non-zero code, or any
        exit of a session's worker but one that left at a resize."""
        code = worker.exit_code()
        return code is not None and (code != 0 or (self.persistent and not worker.resized))

    def _has_failed(self, worker: Worker) -> bool:
        if worker.error is not None and not worker.idle:
            return True
        return self._exit_failed(worker) and worker.exited_at is not None \
            and worker.has_ended()

    def await_the_gone(self, wait: Callable[[float], object]) -> None:
        """Wait, briefly, for ranks whose process is gone but whose end is not yet seen (a
        kill a moment ago: its report pipe's end and its shepherd's word are on their way;
        ``wait(seconds)`` records what comes). A peer's "connection closed" can come first;
        a teardown then would date the death after itself and take the peer for the cause."""
        gone = [w for w in self.workers if w.ended_at is None and w.process_gone()]
        # its pipe's end comes at once; else its shepherd's exit counts after a grace
        deadline = time.monotonic() + NOTICE_GRACE + CHANNEL_CLOSE_GRACE
        while gone and time.monotonic() < deadline:
            self._note_exits()
            if all(w.has_ended() and w.exit_code() is not None for w in gone):
                return
            wait(0.02)

    def tear_down(self) -> float:
        """Stop every worker at once (no waiting for collective timeouts); the time of the
        teardown, to tell who failed on their own from who was stopped by it."""
        teardown_at = time.time()
        self.stop_now()
        return teardown_at

    def failures_before(self, teardown_at: float) -> list[RankFailure]:
        """After a teardown (and once its reports are recorded): the workers that failed on
        their own, root cause first. Every worker is marked FAILED or STOPPED."""
        self._note_exits()
        failures = [
            w.failure() for w in self.workers
            if (w.error is not None and not w.idle and w.error.time <= teardown_at)
            or ((w.error is None or w.idle) and w.ended_at is not None
                and w.ended_at <= teardown_at and self._exit_failed(w))
        ]
        for worker in self.workers:
            worker.state = WorkerState.FAILED if worker.error else WorkerState.STOPPED
        return root_cause_order(failures)

    def stop_now(self) -> None:
        """SIGTERM, then SIGKILL: a teardown or a regroup."""
        self._stop(TEARDOWN_ESCALATION)

    def interrupt(self) -> None:
        """A stop request: SIGINT first (the cell sees KeyboardInterrupt), then escalate."""
        self._stop(INTERRUPT_ESCALATION)

    def _stop(self, escalation: Escalation) -> None:
        stop(self.workers, escalation)
        join_threads(self.workers, timeout=2.0)
        for worker in self.workers:
            if worker.state is not WorkerState.SUCCEEDED:
                worker.state = WorkerState.STOPPED

    def release(self) -> None:
        """Every rank has its result (or left at a commit): let the workers exit, then
        collect their output."""
        for worker in self.workers:
            worker.send(Exit())
        if not wait_for_exit(self.workers, _EXIT_AFTER_RESULTS_TIMEOUT):
            stop(self.workers, TEARDOWN_ESCALATION)
        for worker in self.workers:
            worker.close_control()
        join_threads(self.workers)

    def close(self, spare: Collection[Worker] = ()) -> None:
        """Whatever happened: no worker left running, every pump drained; but ``spare``
        (survivors kept for the next group)."""
        workers = [w for w in self.workers if not any(w is s for s in spare)]
        stop(workers, TEARDOWN_ESCALATION)
        join_threads(workers)

    def results(self) -> dict[int, Result]:
        return {w.global_rank: w.result for w in self.workers if w.result is not None}

    def tails(self) -> dict[int, list[str]]:
        return {w.global_rank: list(w.tail) for w in self.workers}
