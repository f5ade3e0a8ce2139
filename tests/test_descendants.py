"""Everything a worker starts ends with it: on stop, on success, on restart. Real jobs
whose ranks fork children that ignore SIGINT and SIGTERM, one of them in a new session
(see ``FORK_STUBBORN_CHILDREN``); kernel death is in test_kernel.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conftest import (
    FORK_STUBBORN_CHILDREN,
    assert_stayed,
    forked_children,
    survivors,
    tagged_workers,
)

import elastic_magic as em
from elastic_magic.agent.node import workers
from elastic_magic.wire.events import JobState, Output, WorkerFailed
from elastic_magic.wire.payload import build_payload
from elastic_magic.worker.shepherd import TERM_FROM_VARIABLE


def test_stop_ends_what_the_ranks_forked(tmp_path, log_dir):
    spec = em.JobSpec.create(2, log_dir=log_dir)
    cell = FORK_STUBBORN_CHILDREN + "time.sleep(600)\n"
    job = em.Job(spec, build_payload(cell, spec, namespace={"PID_DIR": str(tmp_path)}))
    job.start()
    up: set[int] = set()

    def watch(events):
        up.update(e.rank for e in events if isinstance(e, Output) and "children up" in e.lines)
        if len(up) == 2 and job.state is JobState.RUNNING:
            job.stop("test")

    started = time.monotonic()
    result = job.wait(watch)
    assert result.state is JobState.STOPPED
    assert len(forked_children(tmp_path)) == 4
    assert not survivors(tmp_path), "forked children outlived job.stop()"
    assert not tagged_workers()
    # SIGINT ends the ranks; what they left is SIGKILLed at once, not after the escalation.
    assert time.monotonic() - started < 60


def test_children_left_running_by_a_successful_job_end_with_it(tmp_path, log_dir):
    cell = FORK_STUBBORN_CHILDREN + "'done'\n"
    result = em.launch(cell, nproc=2, namespace={"PID_DIR": str(tmp_path)}, log_dir=log_dir,
                       render=lambda e: None)
    assert result.values == {0: "done", 1: "done"}
    assert len(forked_children(tmp_path)) == 4
    assert not survivors(tmp_path), "forked children outlived a job that succeeded"


# In a cell: whether a child marked by FORK_STUBBORN_CHILDREN still runs.
RUNNING = textwrap.dedent("""
    def running(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
""")

RESTART = textwrap.dedent("""
    import os, psutil, time, torch.distributed as dist
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        PID_DIR = FIRST
        {children}
        dist.barrier()
        if dist.get_rank() == 1:
            raise RuntimeError("crash with children running")
        time.sleep(600)

    {running}

    # The new group starts once the failed one has ended, all it started included.
    [name for name in os.listdir(FIRST) if running(int(name.removesuffix(".pid")))]
""").replace("{running}", RUNNING)


def test_a_restart_ends_what_the_failed_attempt_forked(tmp_path, log_dir):
    first = tmp_path / "first_attempt"
    first.mkdir()
    children = textwrap.indent(FORK_STUBBORN_CHILDREN, " " * 4).strip()
    result = em.launch(RESTART.replace("{children}", children), nproc=2, max_restarts=1,
                       namespace={"FIRST": str(first)}, log_dir=log_dir,
                       render=lambda e: None)
    assert result.restarts == 1
    assert result.values == {0: [], 1: []}, "children of the failed attempt still ran"
    assert len(forked_children(first)) == 4 and not survivors(first)


KILLED_WITH_CHILDREN = textwrap.dedent("""
    import os, psutil, signal, time, elastic_magic, torch.distributed as dist
    state = elastic_magic.State(step=0)
    if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0:
        PID_DIR = os.path.join(FIRST, os.environ["RANK"])
        os.mkdir(PID_DIR)
        {children}
        state.commit()
        dist.barrier()
        past = os.path.join(FIRST, "rank 0 is past the barrier")
        if dist.get_rank() == 0:
            open(past, "w").close()
        else:  # rank 0 sleeps, out of the collective, when rank 1 dies
            while not os.path.exists(past):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)

    {running}

    # The killed rank's children, as the next group runs: none (its survivor's run on).
    dead = os.path.join(FIRST, "1")
    [name for name in os.listdir(dead) if running(int(name.removesuffix(".pid")))]
""").replace("{running}", RUNNING)


def test_a_rank_killed_with_children_is_judged_at_once_and_they_end_before_the_next_group(
        tmp_path, log_dir, recorder):
    """Survivors stay: the agent learns how the rank ended from its shepherd as soon as it
    has (before the shepherd has ended what it left, ``worker/shepherd.py``), so its peer
    parks and the next round forms meanwhile; the next group starts only once nothing of
    the killed rank is left (``Survivors.bury``)."""
    first = tmp_path / "first_attempt"
    first.mkdir()
    children = textwrap.indent(FORK_STUBBORN_CHILDREN, " " * 4).strip()
    result = em.launch(KILLED_WITH_CHILDREN.replace("{children}", children), nproc=2,
                       max_restarts=1, survivors=True, namespace={"FIRST": str(first)},
                       log_dir=log_dir, render=recorder)
    assert result.values == {0: [], 1: []}, "children of the killed rank still ran"
    (failed,) = recorder.of(WorkerFailed)
    assert (failed.failure.rank, failed.failure.signal) == (1, "SIGKILL")
    assert_stayed(recorder, [(0,)])
    for rank in ("0", "1"):  # the survivor's ended with the job
        assert len(forked_children(first / rank)) == 2 and not survivors(first / rank)


def test_the_workers_exit_passes_through_its_shepherd_though_seen_after_its_peers_error(
        tmp_path, log_dir, monkeypatch):
    """The agent sees the rank through its shepherd: a signal that killed the worker is
    the one reported (SIGTERM here; exit codes and SIGKILL in test_jobs.py), and it is the
    root cause though the agent learns of it after the peer's "connection closed" (a loaded
    machine: the rank's pipe end read late, its shepherd slow to reap; here the shepherd is
    stopped and continued 0.3 s after the death, the pipe end read 0.5 s late)."""
    real = workers._read_reports

    def read_the_end_late(worker, channel, notice, inbox):
        if worker.global_rank == 1:
            recv = channel.recv

            def late_eof():
                try:
                    return recv()
                except EOFError:
                    time.sleep(0.5)
                    raise
            channel.recv = late_eof
        real(worker, channel, notice, inbox)

    monkeypatch.setattr(workers, "_read_reports", read_the_end_late)
    shepherd_file = tmp_path / "shepherd"
    cell = ("import os, signal, torch.distributed as dist\n"
            "if dist.get_rank() == 1:\n"
            "    open(SHEPHERD_FILE + '.tmp', 'w').write(str(os.getppid()))\n"
            "    os.rename(SHEPHERD_FILE + '.tmp', SHEPHERD_FILE)\n"
            "    os.kill(os.getppid(), signal.SIGSTOP)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "dist.barrier()\n")

    def continue_the_shepherd():  # a stopped process cannot exit: its PID is still its own
        deadline = time.monotonic() + 60
        while not shepherd_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        shepherd = int(shepherd_file.read_text())
        try:  # until the worker has died under it
            while _state(shepherd) not in ("T", None) or _living_children(shepherd):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)
        finally:
            if _state(shepherd) == "T":
                os.kill(shepherd, signal.SIGCONT)

    waker = threading.Thread(target=continue_the_shepherd, daemon=True)
    waker.start()
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, log_dir=log_dir, render=lambda e: None,
                  namespace={"SHEPHERD_FILE": str(shepherd_file)})
    waker.join(timeout=10)
    assert not waker.is_alive()
    failures = err.value.result.failures
    assert [(f.rank, f.signal) for f in failures[:1]] == [(1, "SIGTERM")], failures
    assert [f.rank for f in failures] == [1, 0]  # the peer's lost connection after it


def _state(pid: int) -> str | None:
    """The process's state letter (T: stopped); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _living_children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            children = [int(child) for child in file.read().split()]
    except OSError:
        return []
    return [child for child in children if _state(child) not in ("Z", "X", None)]


SHEPHERDED = textwrap.dedent("""
    import os, signal, sys, time
    import elastic_magic as em
    from elastic_magic.wire.payload import build_payload
    spec = em.JobSpec.create(1, log_dir=sys.argv[1])
    job = em.Job(spec, build_payload(sys.argv[2], spec, namespace={"PID_DIR": sys.argv[3]}))
    job.start()
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["the kernel is SIGKILLed", "its worker is SIGKILLed"])
def test_the_shepherd_ends_everything_when(tmp_path, log_dir, how):
    """Without the agent's help: the process that ran the job is SIGKILLed (the shepherd's
    PR_SET_PDEATHSIG), or the worker is, leaving its forked children (the shepherd
    outlives and ends them)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    cell = FORK_STUBBORN_CHILDREN + "time.sleep(600)\n"
    kernel = subprocess.Popen([sys.executable, "-c", SHEPHERDED, str(log_dir), cell,
                               str(pid_dir)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(forked_children(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(forked_children(pid_dir)) == 2
        # The forked children share the worker's command line. The worker is known by its
        # shepherd's name, which the shepherd's bare interpreter sets once it has started.
        workers: list = []
        while len(workers) != 1 and time.monotonic() < deadline:
            workers = [p for p in tagged_workers() if p.pid not in forked_children(pid_dir)]
            time.sleep(0.01)
        (worker,) = workers
        if how == "the kernel is SIGKILLed":
            os.kill(kernel.pid, signal.SIGKILL)
        else:
            worker.kill()
        deadline = time.monotonic() + 5
        while survivors(pid_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not survivors(pid_dir)
    finally:
        os.killpg(kernel.pid, signal.SIGKILL)  # our own stand-in kernel, by its group
        kernel.wait()


def test_signals_for_the_rank_reach_the_worker_through_its_shepherd(tmp_path, log_dir):
    """SIGUSR1 sent to the PID the agent shows (the shepherd) reaches the worker."""
    cell = textwrap.dedent("""
        import signal, threading, time
        got = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *a: got.set())
        print("ready", flush=True)
        while not got.is_set():
            time.sleep(0.01)
        "got it"
    """)
    spec = em.JobSpec.create(1, log_dir=log_dir)
    job = em.Job(spec, build_payload(cell, spec, namespace={})).start()
    sent = threading.Event()

    def watch(events):
        if not sent.is_set() and any(isinstance(e, Output) and "ready" in e.lines
                                     for e in events):
            os.kill(job.status_snapshot.shepherds[0], signal.SIGUSR1)  # relayed
            sent.set()

    assert job.wait(watch).values == {0: "got it"}


def wait_until_taken(pid: int, sig: int, timeout: float = 30.0) -> None:
    """Until no thread of ``pid`` (nor the process) has ``sig`` pending."""
    bit = 1 << (sig - 1)

    def pending() -> bool:
        fields = [f"/proc/{pid}/status"] + [f"/proc/{pid}/task/{t}/status"
                                             for t in os.listdir(f"/proc/{pid}/task")]
        for path in fields:
            try:
                with open(path) as status:
                    lines = status.readlines()
            except FileNotFoundError:  # a thread that has ended since
                continue
            for line in lines:
                name, _, value = line.partition(":")
                if name in ("SigPnd", "ShdPnd") and int(value, 16) & bit:
                    return True
        return False

    deadline = time.monotonic() + timeout
    while pending():
        assert time.monotonic() < deadline, f"{pid} never took signal {sig}"
        time.sleep(0.005)


def test_a_joined_rank_takes_sigterm_only_from_its_agent(tmp_path, log_dir, monkeypatch):
    """A scheduler's SIGTERM reaches every process of a joined machine's job (Slurm, at a
    preemption): its agent decides (it leaves at the next commit), so the rank and its
    shepherd let it pass; the agent's own SIGTERM, relayed by the shepherd, ends the rank."""
    monkeypatch.setenv(TERM_FROM_VARIABLE, str(os.getpid()))  # as `elastic-magic join` does
    go = tmp_path / "go"
    cell = textwrap.dedent(f"""
        import os, time
        print("ready", os.getpid(), flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print("went on", flush=True)
        time.sleep(600)
    """)
    spec = em.JobSpec.create(1, log_dir=log_dir)
    job = em.Job(spec, build_payload(cell, spec, namespace={})).start()
    seen: list[str] = []

    def watch(events):
        for e in events:
            if not isinstance(e, Output):
                continue
            shepherd, text = job.status_snapshot.shepherds[0], " ".join(e.lines)
            if text.startswith("ready") and not seen:
                worker = text.split()[1]
                # another process's SIGTERM (as Slurm's) to the shepherd and the worker:
                # pending or dropped once kill returns, so the worker never sees "go" first
                subprocess.run(["kill", "-TERM", str(shepherd), worker], check=True)
                # Taken by both before the agent's: two SIGTERMs pending at once are one,
                # with the first sender's PID (a loaded machine may not have run them yet).
                for pid in (shepherd, int(worker)):
                    wait_until_taken(pid, signal.SIGTERM)
                go.touch()
                seen.append("ready")
            elif "went on" in text and seen == ["ready"]:
                seen.append("went on")
                os.kill(shepherd, signal.SIGTERM)  # the agent's (ours here)

    result = job.wait(watch)
    assert seen == ["ready", "went on"], seen
    assert result.failure is not None and result.failure.signal == "SIGTERM", result
