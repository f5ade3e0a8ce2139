"""Hangs in real jobs (real workers, gloo, c10d rendezvous): the stall watchdog, timeouts
and early exits blamed on the rank at fault, and every rank's stacks while a job runs."""

from __future__ import annotations

import textwrap
import threading
import time

import pytest
from test_multinode import machines as machines  # the fixture: `elastic-magic join` processes
from test_multinode import run_head

import elastic_magic as em
from elastic_magic.result import describe_failure
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.ui.record import record_text
from elastic_magic.wire.events import RanksFinished, WorkerFailed
from elastic_magic.wire.payload import build_payload

STALL = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    t = torch.ones(1)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(120)
    dist.all_reduce(t)
""")  # rank 1 sleeps at cell line 6; rank 0 waits in all_reduce at cell line 7


def failed(cell: str, recorder, log_dir, **options) -> em.JobResult:
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, log_dir=log_dir, render=recorder, **options)
    return err.value.result


def test_the_watchdog_names_a_rank_stalled_outside_any_collective(log_dir, recorder):
    result = failed(STALL, recorder, log_dir, stall_timeout=3, timeout=60)
    root = result.failure
    assert root.rank == 1 and root.reason.startswith("stalled: no progress for")
    assert "outside any collective" in root.reason and root.cell_line == 6
    assert root.traceback.startswith("Thread MainThread (main)")
    assert "Cell line 6, in <module>\n    time.sleep(120)" in root.traceback
    waiting = [f for f in result.failures if f.rank == 0]
    assert len(waiting) == 1 and waiting[0].consequence
    assert waiting[0].reason == "waited in all_reduce" and waiting[0].cell_line == 7
    assert set(result.stacks) == {0, 1} and "dist.all_reduce(t)" in result.stacks[0]
    assert result.duration < 45, "the watchdog, not the 60 s collective timeout, ended it"
    text = describe_failure(result)
    assert "rank 0: waited in all_reduce at cell line 7 (after rank 1 stalled)" in text
    assert [e.failure.rank for e in recorder.of(WorkerFailed)] == [1, 0]


def test_a_rank_stuck_in_c_code_holding_the_gil_is_named_though_it_cannot_answer(
        log_dir, recorder):
    cell = STALL.replace("time.sleep(120)", "re.match(r'(a+)+$', 'a' * 40 + 'b')  # ages")
    result = failed("import re" + cell, recorder, log_dir, stall_timeout=3, timeout=60)
    root = result.failure
    assert root.rank == 1 and "no answer when asked for its stack" in root.reason
    assert result.stacks[1].startswith("did not answer within 2s")
    assert "dist.all_reduce(t)" in result.stacks[0]


def test_without_the_watchdog_a_timeout_still_blames_the_stalled_rank(log_dir, recorder):
    result = failed(STALL, recorder, log_dir, timeout=5)
    root = result.failure
    assert root.rank == 1 and root.reason.startswith("stalled")
    assert "time.sleep(120)" in root.traceback
    timed_out = [f for f in result.failures if f.rank == 0]
    assert "Timed out" in timed_out[0].message  # its own report, kept as a consequence
    text = describe_failure(result)
    assert text.startswith("Rank 1 failed first")
    assert "  rank 0: Timed out waiting 5000ms for recv operation to complete (after rank 1 " \
           "stalled)" in text
    assert text.count("Traceback (most recent call last)") == 0  # no traceback for rank 0
    # rank 1 was the one stuck: its stacks are kept, in the result and in the record
    assert list(result.stacks) == [1] and "Cell line 6" in result.stacks[1]
    state = DashboardState(result.run_id, str(log_dir), 0)
    for event in recorder.events:
        state.apply(event)
    record = record_text(state)
    assert "root cause: rank 1: stalled" in record
    assert "stacks of the stuck ranks, kept when the job failed:" in record
    assert "    time.sleep(120)" in record


EARLY = textwrap.dedent("""
    import torch, torch.distributed as dist
    t = torch.ones(1)
    dist.barrier()
    if dist.get_rank() == 0:
        dist.all_reduce(t)  # rank 1 never comes
""")


def test_a_rank_that_returns_while_others_wait_is_the_root_cause(log_dir, recorder):
    result = failed(EARLY, recorder, log_dir, timeout=5)
    root = result.failure
    assert root.rank == 1 and root.reason == ("returned early: its cell finished while rank 0 "
                                              "waited in a collective")
    assert "(after rank 1 returned early)" in describe_failure(result)
    (finished,) = recorder.of(RanksFinished)  # news at once, not at the timeout
    assert finished.ranks == (1,) and finished.running == (0,)
    assert finished.time < recorder.of(WorkerFailed)[0].time - 2


def test_the_watchdog_catches_an_early_return_too(log_dir, recorder):
    result = failed(EARLY, recorder, log_dir, stall_timeout=3, timeout=60)
    assert result.failure.rank == 1 and result.failure.reason.startswith("returned early")
    assert result.duration < 45


WAITING = textwrap.dedent("""
    import os, threading, time
    def load():
        while not os.path.exists(FLAG):
            time.sleep(0.2)
    threading.Thread(target=load, name="loader", daemon=True).start()
    print("up", flush=True)
    while not os.path.exists(FLAG):
        time.sleep(0.2)
    import torch.distributed as dist
    dist.get_rank()
""")  # the main thread waits at cell line 9


def _wait_for_up(lines, ranks: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all("up" in lines(r) for r in range(ranks)):
            return
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


def test_stacks_of_a_running_job_without_stopping_it(tmp_path, log_dir, recorder):
    flag = tmp_path / "go"
    spec = em.JobSpec.create(2, log_dir=log_dir)
    job = em.Job(spec, build_payload(WAITING, spec, namespace={"FLAG": str(flag)})).start()
    waiter = threading.Thread(target=lambda: job.wait(recorder), daemon=True)
    waiter.start()
    try:
        _wait_for_up(recorder.lines, 2)
        stacks = job.stacks()
    finally:
        flag.touch()
        waiter.join(timeout=60)
    assert sorted(stacks) == [0, 1]
    for text in stacks.values():
        main, loader = text.split("\n\n")
        assert main.startswith("Thread MainThread (main)")
        assert "Cell line 9, in <module>\n    time.sleep(0.2)" in main
        assert loader.startswith("Thread loader,") and "in load\n" in loader
        assert "elastic_magic" not in text  # the worker's own frames and threads are left out
    assert job.result is not None and job.result.ok and job.result.values == {0: 0, 1: 1}


def test_stacks_cover_the_ranks_of_other_machines(tmp_path, machines, log_dir, recorder):
    flag = tmp_path / "go"
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    found: dict[int, str] = {}

    def drive(job):
        try:
            _wait_for_up(recorder.lines, 2, timeout=120)
            found.update(job.stacks())
        finally:
            flag.touch()

    result = run_head(spec, WAITING, recorder, machines, namespace={"FLAG": str(flag)},
                      on_open=lambda: machines.join(1), drive=drive)
    assert result.ok, result
    assert machines.procs[0].wait(timeout=30) == 0, machines.output(0)
    assert sorted(found) == [0, 1]  # rank 1 runs on the other machine
    for text in found.values():
        assert "Cell line 9, in <module>" in text and "Thread loader," in text


def test_elastic_stacks_magic_prints_every_rank(ip, tmp_path, log_dir, capsys):
    flag = tmp_path / "go"
    ip.user_ns["FLAG"] = str(flag)
    job = ip.run_cell_magic("elastic", f"--bg --nproc 2 --log-dir {log_dir}", WAITING)
    try:
        seen, deadline = "", time.monotonic() + 60
        while not ("[rank 0] up" in seen and "[rank 1] up" in seen) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
            seen += capsys.readouterr().out  # the background view prints the ranks' lines
        ip.run_line_magic("elastic", "stacks")
        out = capsys.readouterr().out
    finally:
        flag.touch()
        assert job.wait_done(timeout=60)
    assert "==> rank 0 <==\nThread MainThread (main)" in out and "==> rank 1 <==" in out
    assert out.count("Cell line 9, in <module>") == 2
    ip.run_line_magic("elastic", "stacks")
    assert "has ended (succeeded); it kept no stacks" in capsys.readouterr().out


KILLED = textwrap.dedent("""
    import os, signal, time, torch.distributed as dist
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(1)  # rank 0 waits in the barrier by now
        # Its shepherd stopped, the agent sees rank 1's report pipe close but not how it
        # ended until the teardown's SIGKILL ends the shepherd: rank 0 surely reports its
        # lost peer first (a shepherd tells the agent within milliseconds).
        os.kill(os.getppid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
""")


def test_a_lost_peer_is_a_consequence_of_the_killed_rank(log_dir, recorder):
    result = failed(KILLED, recorder, log_dir, timeout=60)
    assert result.failure.rank == 1 and result.failure.signal == "SIGKILL"
    assert result.stacks == {}  # an ordinary failure: no stacks gathered
    (lost,) = [f for f in result.failures if f.rank == 0]
    assert "closed by peer" in lost.message or "reset by peer" in lost.message
    text = describe_failure(result)
    assert text.startswith("Rank 1 failed first") and "also failed" not in text
    assert "Traceback" not in text  # rank 0's traceback is in its log, not here
    (line,) = [line for line in text.splitlines() if line.startswith("  rank 0: ")]
    assert "by peer" in line and line.endswith("(after rank 1 was killed by SIGKILL)")


# Rank 0 waits for rank 1 in an all_reduce of their own group; ranks 1 and 2 sleep, outside
# any collective. The test stops rank 1's shepherd (SIGSTOP), then SIGKILLs rank 1's worker:
# its report pipe closes at once, but its exit shows only when its shepherd exits, and rank 0
# reports its lost peer meanwhile (a window of 0.05-0.1 s without the SIGSTOP; the chaos test
# of test_survivors found it).
DYING = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    pair = dist.new_group([0, 1])
    dist.barrier()
    if dist.get_rank() == 0:
        open(READY, "w").close()
        dist.all_reduce(torch.ones(1), group=pair)
    while True:
        time.sleep(0.01)
""")


def test_a_rank_whose_pipe_closed_is_the_root_cause_before_its_exit_shows(tmp_path, log_dir,
                                                                         recorder):
    """Not a hang: the busy rank 2 is not blamed ("lagged behind"); the dying rank 1 is."""
    import os
    import signal

    import psutil

    from elastic_magic.agent.handles.job import Job
    from elastic_magic.result import is_consequence
    from elastic_magic.spec import JobSpec

    ready = tmp_path / "ready"
    spec = JobSpec.create(3, log_dir=log_dir, timeout=60)
    job = Job(spec, build_payload(DYING, spec, namespace={"READY": str(ready)})).start()
    deadline = time.monotonic() + 60
    while not ready.exists() and not job.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), "rank 0 never reached its all_reduce"
    shepherd = job.status_snapshot.shepherds[1]
    (worker,) = psutil.Process(shepherd).children()
    os.kill(shepherd, signal.SIGSTOP)  # the teardown's SIGKILL ends it
    os.kill(worker.pid, signal.SIGKILL)
    result = job.wait(recorder)
    assert not result.ok
    assert result.failure.rank == 1 and result.failure.signal == "SIGKILL", result.failure
    assert [f.rank for f in result.failures if not is_consequence(f)] == [1], result.failures
    assert result.stacks == {}  # an ordinary failure: no hang to diagnose
