"""Event lists recorded from real jobs, for the dashboard's unit tests: its state, the live
view and the saved record are fed what the agent emitted, and no worker is started.

Each was recorded once from a real ``Job`` of tests/test_dashboard.py's cells (``job.wait``
with a renderer that kept every event, then ``repr`` of each), and is written back here as
recorded: the events, their order, the output's batches (a rank's first line alone, then
the rest of its burst), pids, rounds, times and tracebacks; only the lines of an Output are
made by a helper from the cell that printed them, and the log folder is the test's.
``test_dashboard::test_live_view_follows_a_real_job_with_a_restart`` runs the restart job
again and checks that a real job still emits these lines and this timeline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elastic_magic.result import JobResult, JobState, RankFailure
from elastic_magic.wire.events import (
    Event,
    JobFinished,
    Output,
    RanksRunning,
    RendezvousCompleted,
    Restarting,
    StateChanged,
    WorkerFailed,
    WorkersStarted,
)


@dataclass(frozen=True)
class Recorded:
    """A job's events and what its view is made with (``LiveView`` reads these of a Job)."""

    run_id: str
    log_dir: Path  # the job's: --log-dir's folder of this run
    max_restarts: int
    nproc: int
    events: list[Event]


def _group_starts(round_: int, port: int, pids: tuple[int, ...],
                  times: tuple[float, float, float, float, float]) -> list[Event]:
    """A group's start on one machine as the agent emits it (the round's attempt is round
    - 1 in these jobs): the rendezvous, its round, the workers started, running."""
    rendezvous, completed, starting, started, running = times
    return [StateChanged(JobState.RENDEZVOUS, time=rendezvous),
            RendezvousCompleted(round=round_, node_rank=0, nnodes=1, world_size=len(pids),
                                master_addr="127.0.0.1", master_port=port, time=completed),
            StateChanged(JobState.STARTING, time=starting),
            WorkersStarted(attempt=round_ - 1, restart_count=round_ - 1,
                           ranks=tuple(range(len(pids))), pids=pids, time=started),
            RanksRunning(attempt=round_ - 1, ranks=tuple(range(len(pids))),
                         pids=tuple(pid + 1 for pid in pids), time=running),
            StateChanged(JobState.RUNNING, time=running)]


# tests/test_dashboard.py's FLAKY: each rank prints 400 lines and a warning on stderr;
# rank 1 raises in the first attempt (max_restarts=1), after the barrier.
def _flaky_lines(rank: int, attempt: int, times: tuple[float, float, float]) -> list[Output]:
    """What a rank of FLAKY printed, batched as the agent sent it: the first line alone,
    then the other 399, then the warning on stderr."""
    text = [f"rank {rank} attempt {attempt} line {i}" for i in range(400)]
    first, rest, warning = times
    return [Output(rank, "stdout", tuple(text[:1]), attempt, time=first),
            Output(rank, "stdout", tuple(text[1:]), attempt, time=rest),
            Output(rank, "stderr", (f"warning from {rank}",), attempt, time=warning)]


def restart_job(logs: Path) -> Recorded:
    """``Job(JobSpec.create(nproc=2, max_restarts=1), FLAKY)``: a failure, a restart, a
    success."""
    run_id = "em-f555e733491a"
    broke = RankFailure(
        rank=1, local_rank=1, attempt=0, pid=16205, time=1795821128.578932,
        exc_type="ValueError", message="first attempt breaks",
        traceback=("Traceback (most recent call last):\n  Cell line 10, in <module>\n"
                   '    raise ValueError("first attempt breaks")\n'
                   "ValueError: first attempt breaks\n"),
        cell_line=10, source_line='raise ValueError("first attempt breaks")', exit_code=1,
        log_dir=str(logs / run_id / "group_0" / "rank_1"))
    events: list[Event] = [
        *_group_starts(1, 44031, (16202, 16205), (1795821120.712792, 1795821120.7965996,
                       1795821120.7966795, 1795821128.4397523, 1795821128.4957867)),
        *_flaky_lines(1, 0, (1795821128.5484037, 1795821128.5537848, 1795821128.5538428)),
        *_flaky_lines(0, 0, (1795821128.5634532, 1795821128.5649009, 1795821128.5774639)),
        Output(1, "stderr", tuple(broke.traceback.splitlines()), 0, time=1795821128.6276531),
        StateChanged(JobState.STOPPING, time=1795821128.6282086),
        WorkerFailed(broke, time=1795821128.6732264),
        StateChanged(JobState.RESTARTING, time=1795821128.673367),
        Restarting(restart_count=1, max_restarts=1, root_cause=broke, no_state=True,
                   time=1795821128.6733813),
        *_group_starts(2, 43475, (16214, 16217), (1795821128.673396, 1795821128.6856477,
                       1795821128.685727, 1795821128.6927135, 1795821128.7031648)),
        *_flaky_lines(0, 1, (1795821128.7360032, 1795821128.737064, 1795821128.7371826)),
        *_flaky_lines(1, 1, (1795821128.7384632, 1795821128.740235, 1795821128.7402754)),
        StateChanged(JobState.SUCCEEDED, time=1795821128.8469665),
    ]
    tails = {rank: [f"rank {rank} attempt 1 line {i}" for i in range(201, 400)]
             + [f"warning from {rank}"] for rank in (0, 1)}
    result = JobResult(run_id, JobState.SUCCEEDED, world_size=2, restarts=1, max_restarts=1,
                       duration=8.13887095451355, log_dir=logs / run_id,
                       values={0: 0, 1: 1}, tails=tails, started=1795821120.707995)
    events.append(JobFinished(result, time=1795821128.8469908))
    return Recorded(run_id, logs / run_id, max_restarts=1, nproc=2, events=events)


def failed_job(logs: Path) -> Recorded:
    """``Job(JobSpec.create(nproc=2), ...)`` of a cell whose rank 0 divides by zero after a
    barrier (no restarts): rank 1 is stopped, with no failure of its own."""
    run_id = "em-3b9a917ec20c"
    zero = RankFailure(
        rank=0, local_rank=0, attempt=0, pid=16240, time=1795821128.9414246,
        exc_type="ZeroDivisionError", message="division by zero",
        traceback=("Traceback (most recent call last):\n  Cell line 4, in <module>\n"
                   "    1 / 0\n    ~~^~~\nZeroDivisionError: division by zero\n"),
        cell_line=4, source_line="1 / 0", exit_code=1,
        log_dir=str(logs / run_id / "group_0" / "rank_0"))
    result = JobResult(run_id, JobState.FAILED, world_size=2, restarts=0, max_restarts=0,
                       duration=0.10882282257080078, log_dir=logs / run_id, failure=zero,
                       failures=[zero], tails={0: zero.traceback.splitlines(), 1: []},
                       started=1795821128.8705819)
    events: list[Event] = [
        *_group_starts(1, 40671, (16240, 16246), (1795821128.8708744, 1795821128.880949,
                       1795821128.881021, 1795821128.892594, 1795821128.910881)),
        Output(0, "stderr", tuple(zero.traceback.splitlines()), 0, time=1795821128.9493914),
        StateChanged(JobState.STOPPING, time=1795821128.9497821),
        WorkerFailed(zero, time=1795821128.9731638),
        StateChanged(JobState.FAILED, time=1795821128.979506),
        JobFinished(result, time=1795821128.9795244),
    ]
    return Recorded(run_id, logs / run_id, max_restarts=0, nproc=2, events=events)


def hello_job(logs: Path) -> Recorded:
    """``Job(JobSpec.create(nproc=1), "print('hello')")``."""
    run_id = "em-87700009c70c"
    result = JobResult(run_id, JobState.SUCCEEDED, world_size=1, restarts=0, max_restarts=0,
                       duration=6.289047956466675, log_dir=logs / run_id, values={0: None},
                       tails={0: ["hello"]}, started=1795821129.074132)
    events: list[Event] = [
        *_group_starts(1, 34497, (16365,), (1795821129.0754, 1795821129.087811,
                       1795821129.0878804, 1795821135.0931172, 1795821135.1636767)),
        Output(0, "stdout", ("hello",), 0, time=1795821135.1640763),
        StateChanged(JobState.SUCCEEDED, time=1795821135.3632874),
        JobFinished(result, time=1795821135.363344),
    ]
    return Recorded(run_id, logs / run_id, max_restarts=0, nproc=1, events=events)


def lines_by_group(events: list[Event]) -> dict[tuple[int, int, str], list[str]]:
    """Every Output's lines, by (attempt, rank, stream), in order (the batches joined: how a
    job batches its lines varies with timing, what it prints does not)."""
    found: dict[tuple[int, int, str], list[str]] = {}
    for event in events:
        if isinstance(event, Output):
            found.setdefault((event.attempt, event.rank, event.stream), []).extend(event.lines)
    return found
