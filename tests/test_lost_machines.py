"""Machines lost from a running job, on loopback (tests/test_networks.py does it across
network namespaces): an agent SIGKILLed, or frozen with all its processes (SIGSTOP, a
stand-in for a cut link: only the missing heartbeats tell), a machine that fails for good,
and a link that carries nothing. A lost machine is a membership change: while the job's
bounds allow, the others regroup from the last commit without a restart; below them the
lost machine is the job's root cause."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import socket
import textwrap
import threading
import time

import psutil
import pytest
from test_elastic import STEPS, TRAIN, assert_same_parameters, committed_steps
from test_elastic import baseline as baseline  # the module-scoped fixture
from test_multinode import machines as machines  # the fixture
from test_multinode import run_head

import elastic_magic as em
from elastic_magic.agent.machines.hub import Link, read_into
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import Excluded, RendezvousCompleted, WorkerFailed, WorkersStarted
from elastic_magic.wire.protocol import new_secret

pytestmark = pytest.mark.cluster


def _training_shared(job, recorder) -> bool:
    """Wait until both machines train together and 3 steps were committed since (False
    if the job ended first)."""
    while not any(r.world_size == 2 for r in recorder.of(RendezvousCompleted)):
        if job.done:
            return False
        time.sleep(0.05)
    first_shared = job.last_commit["step"] if job.last_commit else 0
    return job.wait_for_commit(first_shared + 3, timeout=120)


@pytest.mark.parametrize("how", ["killed", "cut", "killed-survivors-stay"])
def test_a_lost_machine_is_a_membership_change_not_a_failure(
        baseline, machines, log_dir, recorder, how):
    """Killed: its agent is SIGKILLed (its link closes without a Leaving). Cut: the agent
    and all its processes are frozen (SIGSTOP), so only the missing heartbeats tell. Either
    way the head regroups alone from the last commit, spending no restart (it has none);
    with survivors staying, the head's rank in its process."""
    survivors = how.endswith("survivors-stay")
    how = how.removesuffix("-survivors-stay")
    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir, timeout=120, link_timeout=3,
                             survivors=survivors)
    frozen: list[psutil.Process] = []
    lost_at: list[int | None] = []  # the last commit when the machine was lost

    def drive(job):
        if not _training_shared(job, recorder):
            return
        lost_at.append(job.last_commit["step"] if job.last_commit else None)
        agent = psutil.Process(machines.procs[0].pid)
        if how == "killed":
            agent.send_signal(signal.SIGKILL)  # ours, by PID
            return
        frozen.extend([agent, *agent.children(recursive=True)])  # ours, by PID
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)

    try:
        result = run_head(spec, TRAIN, recorder, machines,
                          namespace={"KILL_AT": -1, "PAUSE": 0.4},
                          on_open=lambda: machines.join(1), drive=drive)
    finally:
        for proc in reversed(frozen):  # the cut heals: it finds the head gone
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGCONT)
    assert result.ok, recorder.story()
    assert result.restarts == 0 and result.max_restarts == 0 and result.failures == []
    assert lost_at and len(recorder.of(Excluded)) == 1, (lost_at, recorder.story())
    (lost,) = recorder.of(Excluded)
    # Node ranks follow torch's order of the agents (address, then pid).
    assert re.fullmatch(r"machine 127\.0\.0\.1 \(node [01]\)", lost.what) and lost.goes_on
    expected = "closed without notice" if how == "killed" else "no heartbeat for 3s"
    assert expected in lost.why, lost.why
    assert result.excluded == [f"{lost.what}: {lost.why}"]
    # A survivor's "Connection closed by peer" is told as the consequence it is.
    assert all(e.failure.consequence for e in recorder.of(WorkerFailed)), \
        recorder.of(WorkerFailed)
    worlds = [r.world_size for r in recorder.of(RendezvousCompleted)]
    assert 2 in worlds and worlds[-1] == 1, worlds
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    if survivors:  # after the loss, the head's rank went on in its process
        before, after = recorder.of(WorkersStarted)[-2:]
        assert after.stayed == after.ranks and after.pids == before.pids, (before, after)
    rc = machines.procs[0].wait(timeout=60)
    if how == "killed":
        assert rc == -signal.SIGKILL
    else:  # it stopped its workers (the fixture checks they are gone) and said why
        assert rc == 1 and "elastic-magic join: lost the head" in machines.output(0), \
            machines.output(0)


def test_a_lost_machine_below_the_minimum_is_the_root_cause(machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    cell = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"

    def drive(job):
        while len({e.rank for e in recorder.events if getattr(e, "lines", None)}) < 3:
            time.sleep(0.05)  # all three ranks, both machines, are running the cell
        machines.procs[0].send_signal(signal.SIGKILL)  # ours, by PID

    result = run_head(spec, cell, recorder, machines, on_open=lambda: machines.join(2),
                      drive=drive)
    assert result.state is em.JobState.FAILED
    failure = result.failure
    assert failure is not None, result
    found = re.match(r"machine 127\.0\.0\.1 \(node ([01])\) was lost: its link closed "
                     "without notice", failure.headline)
    assert found, failure.headline
    assert failure.rank == (0 if found[1] == "0" else 1)  # its first rank (the head has 1)
    (lost,) = recorder.of(Excluded)
    assert not lost.goes_on and "too few are left" in describe(lost).text


def test_a_link_that_carries_nothing_fails_after_its_timeout():
    left, right = socket.socketpair()
    key = new_secret()
    watched, silent = Link(left, key, "left"), Link(right, key, "right")
    watched.keep_alive(0.5)  # heartbeats out; a read fails after 0.5 s without anything
    inbox: queue.Queue = queue.Queue()
    readers = [threading.Thread(target=read_into, args=(link, node, inbox))
               for node, link in ((1, watched), (2, silent))]
    for reader in readers:
        reader.start()
    lost, closed = sorted((inbox.get(timeout=30), inbox.get(timeout=30)),
                          key=lambda item: item.node)
    assert (lost.node, lost.message) == (1, None)
    assert lost.reason == "no heartbeat for 0.5s (the link is cut, or the machine is frozen)"
    # The other side got heartbeats (not passed on: they are not news), then the close.
    assert (closed.node, closed.message, closed.reason) == (2, None, None)
    for reader in readers:
        reader.join(timeout=30)
    assert not any(t.name.startswith("elastic-heartbeat") for t in threading.enumerate())


def test_a_machine_that_fails_for_good_is_excluded_while_the_bounds_allow(
        machines, log_dir, recorder, tmp_path):
    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir, timeout=120)
    cell = textwrap.dedent("""
        import os, time, torch, torch.distributed as dist
        world = int(os.environ["WORLD_SIZE"])
        if world == 3:
            open(MARK, "w").close()
        elif not os.path.exists(MARK):
            time.sleep(600)  # alone, before the machine came: it regroups the job
        if os.environ["LOCAL_WORLD_SIZE"] == "2" and os.environ["LOCAL_RANK"] == "1":
            raise ValueError("bad shard on the other machine")
        t = torch.ones(1)
        dist.all_reduce(t)
        int(t.item())
    """)
    result = run_head(spec, cell, recorder, machines, on_open=lambda: machines.join(2),
                      namespace={"MARK": str(tmp_path / "together")})
    # That machine had no restart left: the head went on alone, without spending one.
    assert result.ok, result
    assert result.values == {0: 1} and result.restarts == 0
    (excluded,) = recorder.of(Excluded)
    assert excluded.goes_on and excluded.what.startswith("machine 127.0.0.1"), excluded
    assert excluded.why == ("its workers failed with no restart left (ValueError: bad shard "
                            "on the other machine (cell line 9))"), excluded.why
    assert machines.procs[0].wait(timeout=30) == 1
