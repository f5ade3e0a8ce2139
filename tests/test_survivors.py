"""Survivors stay (``--survivors``), beyond the exactness tests that
test_elastic and test_resume run in both modes: which ranks stay after a failure, that a
rank which cannot leave its collective is stopped and started again saying why, and that a
cell without State restarts as before."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import textwrap
import threading
import time
from collections.abc import Callable

import psutil
import pytest
from conftest import ZYGOTE, assert_stayed, is_spare, wait_until_no_workers

from elastic_magic.agent.handles.job import Job
from elastic_magic.agent.node.survivors import STUCK
from elastic_magic.agent.status import JobStatus
from elastic_magic.result import JobState
from elastic_magic.spec import JobSpec
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import (
    Committed,
    Excluded,
    Restarting,
    WorkerFailed,
    WorkersStarted,
)
from elastic_magic.wire.payload import build_payload

# Ten steps of a DDP training with a commit each; at step 3 (then 5, 7) of the first
# FAILURES attempts, rank 1 does FAIL_HOW and rank 0 does STALL (or nothing).
TRAIN = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import elastic_magic

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic_magic.State(model=model, optimizer=opt, step=0)
    first = int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < FAILURES
    rank = dist.get_rank()
    if first and STALL and rank == 0:  # deaf to the agent's interrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    while state.step < 10:
        if first and state.step == 3 + 2 * int(os.environ["TORCHELASTIC_RESTART_COUNT"]):
            if rank == 1:
                FAIL_HOW()
            elif STALL:  # in no collective, deaf: it cannot leave
                while True:
                    time.sleep(0.05)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        state.step += 1
        state.commit()
    [p.detach().clone() for p in model.module.parameters()]
""")


def raise_error():
    raise ValueError("rank 1 broke")


def kill_myself():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def run(log_dir, recorder, fail_how, stall=False, source=TRAIN, failures=1, **spec_args):
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=failures, survivors=True,
                          **spec_args)
    payload = build_payload(source, spec, namespace={"FAIL_HOW": fail_how, "STALL": stall,
                                                     "FAILURES": failures})
    result = Job(spec, payload).start().wait(recorder)
    assert result.ok, result
    assert result.restarts == failures
    return result


def test_a_survivor_stays_through_several_kills_and_ends_as_without_them(log_dir,
                                                                        recorder):
    import torch

    result = run(log_dir, recorder, kill_myself, failures=3)
    assert_stayed(recorder, [(0,), (0,), (0,)])  # the same rank 0 process throughout
    torch.manual_seed(0)  # the training alone, without a job: every step once
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    for got, want in zip(result.values[0], model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-6)


def test_a_rank_that_raised_is_replaced_and_its_peer_stays(log_dir, recorder):
    run(log_dir, recorder, raise_error)
    assert_stayed(recorder, [(0,)])  # rank 0 only lost its peer: it stayed
    assert recorder.of(Restarting)[0].root_cause.exc_type == "ValueError"
    assert not recorder.of(Restarting)[0].no_state  # its ranks use State
    notes = [n.text for e in recorder.events if (n := describe(e)) and n.kind == "start"]
    assert notes[-1] == "started ranks 1 after restart 1; ranks 0 stayed in their processes"


def die_unseen():
    """Rank 1 dies, and the agent cannot see it yet: its shepherd is stopped (no exit) and
    a child of the worker holds its report pipe (no end of it; the stopped shepherd does
    not end the child). Its peer's collective fails at once with a lost peer."""
    import os
    import signal
    import subprocess

    from elastic_magic.worker import client

    report_fd = client.current()._report.fd
    subprocess.Popen(["sleep", "60"], pass_fds=(report_fd,))  # no at-fork handler runs
    shepherd = os.getppid()

    def shepherd_state() -> str:
        with open(f"/proc/{shepherd}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]

    os.kill(shepherd, signal.SIGSTOP)
    while shepherd_state() != "T":
        pass  # stopped before it can see the death
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_death_seen_after_its_peer_lost_it_is_the_root_cause_and_the_peer_stays(
        log_dir, recorder):
    """The chaos test's race, in order: the survivor's lost-peer error reaches the agent
    before anything of the killed rank's death, which the agent sees only while the
    survivors leave (here: its shepherd goes on once the agent is stopping the group). The
    killed rank is the root cause, its slot is left out (no restart left), and the healthy
    rank stays in its process, not the other way round."""
    spec = JobSpec.create(2, log_dir=log_dir, max_restarts=0, min_nproc=1, survivors=True)
    payload = build_payload(TRAIN, spec, namespace={"FAIL_HOW": die_unseen, "STALL": False,
                                                    "FAILURES": 1})
    job = Job(spec, payload).start()
    shepherd: list[int] = []

    def stopped(pid: int) -> bool:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "T"
        return False

    def resume_when_stopping() -> None:
        # Once the agent stops the group, or half a second after rank 1 stopped its shepherd
        # and died (its peer's lost-peer error is in the agent by then, and the agent has
        # not given up on rank 1's stacks, which takes 2 s): under load the agent may not
        # stop the group before that.
        deadline, seen_stopped = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            status = job.status_snapshot
            if 1 in status.shepherds:
                shepherd[:] = [status.shepherds[1]]
            if status.state is JobState.STOPPING or status.done:
                break
            if seen_stopped is None and shepherd and stopped(shepherd[0]):
                seen_stopped = time.monotonic()
            if seen_stopped is not None and time.monotonic() - seen_stopped > 0.5:
                break
            time.sleep(0.002)
        for pid in shepherd:  # (else the agent's teardown ends it: SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    resumer = threading.Thread(target=resume_when_stopping, daemon=True)
    resumer.start()
    result = job.wait(recorder)
    resumer.join(timeout=10)
    assert result.ok, (result, timeline(recorder))
    assert result.restarts == 0
    first = recorder.of(WorkerFailed)[0].failure
    assert (first.rank, first.signal) == (1, "SIGKILL"), timeline(recorder)
    excluded = recorder.of(Excluded)
    assert len(excluded) == 1 and "rank 1: killed by SIGKILL" in excluded[0].why, excluded
    assert_stayed(recorder, [(0,)])  # the healthy rank 0 kept its slot and its process


def test_a_rank_that_cannot_leave_is_stopped_and_started_again_saying_why(log_dir,
                                                                          recorder):
    run(log_dir, recorder, raise_error, stall=True, link_timeout=1.0)
    assert_stayed(recorder, [()])  # rank 0 did not park within the link timeout
    stuck = [e.failure for e in recorder.of(WorkerFailed) if e.failure.reason == STUCK]
    assert [f.rank for f in stuck] == [0]
    assert recorder.of(Restarting)[0].root_cause.rank == 1


# Rank 0 asks for the State, then waits in the making of the default group for rank 1,
# which (the first time) never comes: the survivor leaves torch's init_process_group with
# its timeout, a lost peer's error as when a peer dies while the group is being made.
INTERRUPTED_INIT = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    import elastic_magic
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
        time.sleep(60)
    state = elastic_magic.State(step=0)
    t = torch.ones(1)
    dist.all_reduce(t)
    t.item()
""")


def test_a_survivor_interrupted_while_making_its_group_joins_new_ranks(log_dir, recorder):
    """torch names each default group by a count it resets only when it destroys one: the
    survivor's next group must be named as the new rank names its first (found by the
    chaos test: both waited for each other until the timeout)."""
    result = run(log_dir, recorder, raise_error, source=INTERRUPTED_INIT, timeout=3)
    assert 0 in recorder.of(WorkersStarted)[1].stayed  # the survivor made its group again
    assert result.values == {0: 2.0, 1: 2.0}


# The second group's new rank 1 dies before it makes the group, while the survivor waits
# in the store for its address: a wait that neither errors nor returns on a signal. The
# first group's rank 1 dies between two collectives, to leave a survivor.
DIED_BEFORE_ITS_GROUP = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist
    import elastic_magic
    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if restart == 1 and rank == 1:
        while not os.path.exists(MAKING):
            time.sleep(0.01)
        time.sleep(1.0)  # its peer waits in the store by now
        os.kill(os.getpid(), signal.SIGKILL)
    if restart == 1:
        open(MAKING, "w").close()
    state = elastic_magic.State(step=0)  # the group is made here: it restores a commit
    t = torch.ones(1)
    dist.all_reduce(t)
    if restart == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
    t.item()
""")


def test_a_survivor_waiting_in_the_store_for_a_peer_that_died_leaves_and_stays(
        log_dir, tmp_path, recorder):
    """A rank that dies before it makes its group leaves its peers waiting in the store
    for its address, which no signal interrupts: told to leave, the survivor shuts its
    connection to that group's store, parks and stays (else it was stopped as stuck)."""
    source = DIED_BEFORE_ITS_GROUP.replace("MAKING", repr(str(tmp_path / "making")))
    result = run(log_dir, recorder, None, source=source, failures=2)
    stayed = [s.stayed for s in recorder.of(WorkersStarted)[1:]]
    assert stayed == [(0,), (0,)], timeline(recorder)
    assert_stayed(recorder, stayed)  # in its process
    assert not [e for e in recorder.of(WorkerFailed) if e.failure.reason == STUCK]
    assert result.values == {0: 4.0, 1: 4.0}


@pytest.mark.unit
def test_leaving_a_group_ends_a_wait_in_its_store_and_no_other_connection(monkeypatch):
    """What a rank told to leave does to its group's store (``MASTER_ADDR``, given as a
    name, and ``MASTER_PORT``): a get that waits for a key never written errors at once;
    a connection to another store goes on, and the store serves a new one."""
    from datetime import timedelta

    from torch.distributed import DistNetworkError, TCPStore

    from elastic_magic.result import RankFailure, is_consequence
    from elastic_magic.worker import group_store

    def store(port: int = 0) -> TCPStore:
        return TCPStore("127.0.0.1", port, is_master=not port, wait_for_workers=False,
                        timeout=timedelta(seconds=60))

    group_host, other_host = store(), store()
    waiting, other = store(group_host.port), store(other_host.port)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(group_host.port))
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            waiting.set("waiting", "")
            waiting.get("a peer that died never writes this")
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    watcher = store(group_host.port)
    watcher.wait(["waiting"])
    time.sleep(0.3)  # the get is sent: the next line is a wait that only the cut ends
    assert thread.is_alive()
    assert group_store.leave_store() >= 1
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(raised[0], DistNetworkError), raised
    assert "Connection was likely closed" in str(raised[0])  # its recv, not its send
    failure = RankFailure(rank=0, local_rank=0, attempt=0, pid=1, time=0.0,
                          exc_type="DistNetworkError", message=str(raised[0]))
    assert is_consequence(failure), failure.message  # a lost peer's error: the rank stays
    other.set("key", "value")
    assert other.get("key") == b"value"
    again = store(group_host.port)  # the store itself serves on (it is the agent's)
    again.set("key", "value")
    assert again.get("key") == b"value"


WITHOUT_STATE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
        FAIL_HOW()
    dist.all_reduce(t)
    t.item()
""")


def test_a_cell_without_state_restarts_as_before(log_dir, recorder):
    result = run(log_dir, recorder, raise_error, source=WITHOUT_STATE)
    assert_stayed(recorder, [()])  # nothing to roll back to: every rank started again
    assert result.values == {0: 4.0, 1: 4.0}


def test_the_flag_keeps_survivors_in_a_notebook_cell(ip, log_dir, capsys):
    """%%elastic --survivors: the text output says which rank stayed."""
    ip.user_ns.update(FAIL_HOW=kill_myself, STALL=False, FAILURES=1)
    result = ip.run_cell_magic(
        "elastic", f"--nproc 2 --max-restarts 1 --survivors --text --log-dir {log_dir}",
        TRAIN)
    assert result.ok and result.restarts == 1
    assert "ranks 0 stayed in their processes" in capsys.readouterr().out


# -- chaos: kills and resizes at random moments in one training ----------------------------

# CI fires 120 events (about 2.5 minutes on 2 cores); ELASTIC_MAGIC_CHAOS_EVENTS=200 (or more)
# is the longer run the closing notes report. Each event takes about 3 steps; 6 are given.
CHAOS_EVENTS = int(os.environ.get("ELASTIC_MAGIC_CHAOS_EVENTS", "120"))
CHAOS_STEPS = 6 * CHAOS_EVENTS  # epochs of 20 global batches of 12
# The model, data, optimizer and step, shared by the cell and the run without a job.
CHAOS_SETUP = textwrap.dedent("""
    import torch
    import elastic_magic
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    # which steps these weights went through: restored with them, so a step applied twice
    # or lost shows here whatever the step counter says
    net.register_buffer("applied", torch.zeros(STEPS, dtype=torch.int32))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(240, 8, generator=g)
    target = torch.sin(data.sum(1, keepdim=True))
    sampler = elastic_magic.ElasticSampler(len(data), 12, seed=0)

    def train_step(model, idx, step):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(data[idx]), target[idx]).backward()
        opt.step()
        net.applied[step] += 1
""")
CHAOS = CHAOS_SETUP + textwrap.dedent("""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(net)
    state = elastic_magic.State(model=model, optimizer=opt, sampler=sampler, step=0)
    while state.step < STEPS:
        sampler.set_epoch(state.step // 20)
        for idx in sampler:
            train_step(model, idx, state.step)
            state.step += 1
            state.commit()
    net.applied.tolist(), [p.detach().clone() for p in net.parameters()]
""")


def chaos_reference(steps: int) -> list:
    """The training alone, in this process, without a job: every step once."""
    namespace: dict = {"STEPS": steps}
    exec(CHAOS_SETUP, namespace)  # our own source
    sampler, net, train_step = (namespace[k] for k in ("sampler", "net", "train_step"))
    step = 0
    for epoch in range(steps // 20):
        sampler.set_epoch(epoch)
        for idx in sampler:
            train_step(net, idx, step)
            step += 1
    return [p.detach().clone() for p in net.parameters()]


class Chaos:
    """Fires CHAOS_EVENTS events into a running job, each once the group that the event
    before it made has started, at a random moment: mostly after that group committed two
    or three steps, plus up to a step's time (in a step, in a commit); one in five while
    it starts (its ranks restoring the State). Each event is a SIGKILL of a random rank's
    worker (by PID: the child of the rank's shepherd) or a resize to another size in 1..3,
    with every slot a failure left out named back (a slot that fails again is excluded
    while --min-nproc allows)."""

    def __init__(self, job: Job, seed: int) -> None:
        self.job = job
        self.rng = random.Random(seed)
        self.killed: list[int] = []  # the workers' PIDs
        self.resized: list[int] = []  # the sizes asked for
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            pids: dict[int, int] = {}
            for _ in range(CHAOS_EVENTS):
                pids = self._next_group(pids)
                if self.rng.random() < 0.8:
                    step_time = self._commits(self.rng.randint(2, 3))
                    time.sleep(self.rng.uniform(0, step_time))
                if self.rng.random() < 0.5:
                    self._kill(pids)
                else:
                    self._resize(len(pids))
        except BaseException as error:  # the test reports it
            self.error = error

    def _until(self, ready: Callable[[JobStatus], bool], what: str) -> JobStatus:
        deadline = time.monotonic() + 60
        while not ready(status := self.job.status_snapshot):
            if status.done:
                raise AssertionError(f"{what}: the job ended after {len(self.killed)} kills "
                                     f"and {len(self.resized)} resizes")
            if time.monotonic() > deadline:
                stacks = "\n".join(f"rank {rank}:\n{text}"
                                   for rank, text in self.job.stacks().items())
                raise AssertionError(f"{what}: not within 60 s after {len(self.killed)} kills "
                                     f"and {len(self.resized)} resizes ({status}); the ranks' "
                                     f"stacks:\n{stacks}")
            time.sleep(0.005)
        return status

    def _next_group(self, before: dict[int, int]) -> dict[int, int]:
        """The ranks' shepherd PIDs of the next group, once every rank of it started."""
        status = self._until(lambda s: bool(s.shepherds) and dict(s.shepherds) != before
                             and len(s.shepherds) == s.world_size, "the next group")
        return dict(status.shepherds)

    def _commits(self, count: int) -> float:
        """Wait for ``count`` (2 or more) commits made from now on; the time between the
        last two (a step and its commit)."""
        times = [time.time()]
        for _ in range(count):
            times.append(self._commit_after(times[-1]))
        return times[-1] - times[-2]

    def _commit_after(self, since: float) -> float:
        """When the first commit made after ``since`` was made."""
        status = self._until(lambda s: s.last_commit is not None
                             and s.last_commit["time"] > since, "a commit")
        assert status.last_commit is not None
        return float(status.last_commit["time"])

    def _kill(self, pids: dict[int, int]) -> None:
        rank = self.rng.choice(sorted(pids))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # a rank just forked may have no worker yet
            with contextlib.suppress(psutil.NoSuchProcess):
                if workers := psutil.Process(pids[rank]).children():
                    os.kill(workers[0].pid, signal.SIGKILL)
                    self.killed.append(workers[0].pid)
                    return
            time.sleep(0.005)
        raise AssertionError(f"rank {rank} (shepherd {pids[rank]}) had no worker to kill")

    def _resize(self, size: int) -> None:
        target = self.rng.choice([n for n in (1, 2, 3) if n != size])
        self.job.scale(target, include=range(8))
        self.resized.append(target)


def timeline(recorder, last: int = 40) -> str:
    """The job's last ``last`` notes (as the dashboard's timeline says them), timed."""
    first = recorder.events[0].time if recorder.events else 0.0
    notes = [f"{event.time - first:8.2f} s  {note.text}" for event in recorder.events
             if (note := describe(event)) is not None]
    return "\n".join(notes[-last:])


@pytest.mark.soak
@pytest.mark.timeout(900)
def test_chaos_kills_and_resizes_apply_every_step_once(log_dir, recorder):
    """One training with a State committing every step, survivors staying, through
    CHAOS_EVENTS kills and resizes at random moments: it ends with every step applied once,
    at the parameters of the training without a job (within float rounding: the sizes sum
    the global batch in other orders), and no process of the job is left."""
    import torch

    seed = int(os.environ.get("ELASTIC_MAGIC_CHAOS_SEED") or random.randrange(2**32))
    spec = JobSpec.create(2, log_dir=log_dir, min_nproc=1, max_nproc=3,
                          max_restarts=CHAOS_EVENTS, survivors=True)
    job = Job(spec, build_payload(CHAOS, spec, namespace={"STEPS": CHAOS_STEPS})).start()
    chaos = Chaos(job, seed)
    driver = threading.Thread(target=chaos.run, daemon=True)
    started = time.monotonic()
    driver.start()
    result = job.wait(recorder)
    driver.join(timeout=10)
    starts = recorder.of(WorkersStarted)
    kept = sum(bool(s.stayed) for s in starts[1:])
    why = (f"chaos seed {seed} (ELASTIC_MAGIC_CHAOS_SEED={seed} replays its choices, not "
           f"their timing): {len(chaos.killed)} kills, {len(chaos.resized)} resizes, "
           f"{len(starts)} groups, {kept} of them kept survivors, "
           f"{time.monotonic() - started:.0f} s")
    print(why)  # with -s
    why += "\n" + timeline(recorder)
    assert chaos.error is None, f"{why}: {chaos.error!r}"
    assert result.ok, f"{why}: {result}"
    assert len(chaos.killed) + len(chaos.resized) == CHAOS_EVENTS, why
    # Every failure was one of the kills: a restart, or the slot left out (it failed before),
    # named after the kill even when a peer's lost-connection error reached the agent before
    # the killed rank's pipe closed (that peer was named, and its healthy slot excluded, about
    # twice in 100 kills before the fix).
    restarts = recorder.of(Restarting)
    excluded = recorder.of(Excluded)
    # The long timeline is cut in pytest's report: the offenders are named first.
    named = [(f"restart {r.restart_count}", f"rank {r.root_cause.rank}", r.root_cause.headline)
             for r in restarts if r.root_cause.signal != "SIGKILL"]
    assert not named, f"restarts named after no kill: {named}\n{why}"
    assert all("killed by SIGKILL" in e.why for e in excluded), why
    assert len(restarts) + len(excluded) == len(chaos.killed), why
    # Every step once: committed in order, and in the weights' own record of their steps.
    assert [e.step for e in recorder.of(Committed)] == list(range(1, CHAOS_STEPS + 1)), why
    applied, params = result.values[0]
    assert [step for step, times in enumerate(applied) if times != 1] == [], why
    # Summing the global batch in another order (2 or 3 ranks) all along moves the weights
    # by up to 1.5e-5 over the 1200 steps; one step lost or applied twice, by 0.02 or more.
    for got, want in zip(params, chaos_reference(CHAOS_STEPS), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3, msg=lambda m: f"{why}: {m}")
    # Survivors stayed, each in its own process; no process of the job is left.
    assert kept >= len(starts) // 3, why
    assert_stayed(recorder, [s.stayed for s in starts[1:]])
    assert wait_until_no_workers(timeout=10) == [], why
    descendants = psutil.Process().children(recursive=True)
    assert [p for p in descendants if p.name() != ZYGOTE and not is_spare(p)] == [], why
