"""Jobs across machines: the kernel's agent (the head) and `elastic-magic join` agents (real
separate processes, each its own node in torch's c10d rendezvous) on loopback.

Acceptance for multi-node elasticity: a resize on the head, or a machine joining, makes
every node re-rendezvous; training carries on from the last commit with no step lost or
run twice, and ends with the parameters of the uninterrupted single-machine run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_stayed, tagged_workers
from test_elastic import STEPS, TRAIN, assert_same_parameters, committed_steps, done_steps
from test_elastic import baseline as baseline  # the module-scoped fixture

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.agent.machines.rendezvous import _size_and_agent
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.wire.events import AcceptingNodes, NodeConnected, RendezvousCompleted
from elastic_magic.wire.payload import build_payload

pytestmark = pytest.mark.cluster


class Machines:
    """`elastic-magic join` processes started for one test; every one is reaped."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.endpoint: str | None = None
        self.token: str | None = None

    def join(self, nproc: int, token: str | None = None) -> subprocess.Popen[bytes]:
        """`elastic-magic join` as the notebook prints it: the token in the environment."""
        assert self.endpoint is not None, "the head has not opened its rendezvous yet"
        n = len(self.procs)
        out = (self.tmp_path / f"node{n}.out").open("wb")
        token = token or self.token
        assert token is not None
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_magic.cli", "join", self.endpoint,
             "--nproc", str(nproc), "--log-dir", str(self.tmp_path / f"node{n}-logs")],
            stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp_path,
            stdin=subprocess.DEVNULL, env={**os.environ, "ELASTIC_MAGIC_TOKEN": token},
        )
        out.close()
        self.procs.append(proc)
        return proc

    def output(self, index: int) -> str:
        return (self.tmp_path / f"node{index}.out").read_text()

    def reap(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)  # ours, by PID
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@pytest.fixture
def machines(tmp_path):
    found = Machines(tmp_path)
    yield found
    found.reap()


def run_head(spec, source, recorder, machines, *, namespace=None, on_open=None, drive=None):
    """Run the head's job to the end; ``on_open`` runs once its rendezvous accepts
    machines, ``drive`` on a thread alongside."""
    job = Job(spec, build_payload(source, spec, namespace=namespace or {})).start()

    def render(events):
        recorder(events)
        for event in events:
            if isinstance(event, AcceptingNodes):
                machines.endpoint = event.endpoint
                machines.token = job.token
                if on_open is not None:
                    on_open()

    driver = threading.Thread(target=drive, args=(job,), daemon=True) if drive else None
    if driver:
        driver.start()
    result = job.wait(render)
    if driver:
        driver.join(timeout=10)
    return result


PROBE = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} on node {os.environ['GROUP_RANK']}", flush=True)
    {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "WORLD_SIZE")} | {"sum": t.item()}
""")


def test_two_machines_run_one_job_and_report_to_the_notebook(machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    result = run_head(spec, PROBE, recorder, machines, on_open=lambda: machines.join(2))
    assert result.ok, result
    assert machines.procs[0].wait(timeout=30) == 0, machines.output(0)
    assert result.world_size == 3 and sorted(result.values) == [0, 1, 2]
    for rank, env in result.values.items():
        assert int(env["RANK"]) == rank and env["WORLD_SIZE"] == "3"
        assert env["GROUP_WORLD_SIZE"] == "2" and env["sum"] == 6.0
    by_node: dict[str, list[int]] = {}
    for rank, env in result.values.items():
        by_node.setdefault(env["GROUP_RANK"], []).append(rank)
    # Ranks as torch assigns them: contiguous per node, local ranks from 0.
    assert sorted(len(r) for r in by_node.values()) == [1, 2]
    for ranks in by_node.values():
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))
        assert [int(result.values[r]["LOCAL_RANK"]) for r in ranks] == list(range(len(ranks)))
    # Every rank's output reached the notebook, the other machine's too.
    for rank, env in result.values.items():
        assert f"rank {rank} on node {env['GROUP_RANK']}" in recorder.lines(rank)
    assert [e.nproc for e in recorder.of(NodeConnected) if e.connected] == [2]
    (round_,) = recorder.of(RendezvousCompleted)
    assert round_.nnodes == 2 and round_.world_size == 3
    # Each machine named with its ranks (the charts' band per machine): the head as such,
    # the other as its agent (machines rehearsed on one host share the address).
    assert dict(round_.machines) == {"127.0.0.1 (head)": 1,
                                     f"127.0.0.1 (pid {machines.procs[0].pid})": 2}
    # an IPv6 agent, and a machine of an older elastic_magic (the size alone) by its node rank
    assert _size_and_agent("2 ::1 4242", 1) == (2, "::1", 4242)
    assert _size_and_agent("3", 2) == (3, "node 2", 0)
    # The dashboard shows the other machine's ranks as tabs of their own.
    dashboard = DashboardState(result.run_id, str(result.log_dir), 0)
    for event in recorder.events:
        dashboard.apply(event)
    assert sorted(dashboard.lines) == [0, 1, 2]
    for rank, env in result.values.items():
        assert ("stdout", f"rank {rank} on node {env['GROUP_RANK']}") in dashboard.lines[rank]
    paths = dashboard.log_paths()
    local = {r for r, env in result.values.items() if env["LOCAL_WORLD_SIZE"] == "1"}
    for rank in (0, 1, 2):
        assert (rank in local) == paths[rank]["stdout"].endswith("stdout.log"), paths


@pytest.mark.parametrize("immediate", [False, True], ids=["at_commit", "now"])
def test_resize_on_the_head_makes_every_machine_re_rendezvous(
        baseline, machines, log_dir, recorder, immediate):
    spec = em.JobSpec.create(1, nnodes=2, max_nproc=2, log_dir=log_dir, timeout=120)

    def drive(job):
        job.wait_for_commit(10, timeout=120)
        # At the commit every rank on both machines leaves; now: the head stops its ranks
        # and tells the other machine to regroup before its ranks lose their peers.
        job.scale(2, immediate=immediate)

    result = run_head(spec, TRAIN, recorder, machines, namespace={"KILL_AT": -1, "PAUSE": 0.05},
                      on_open=lambda: machines.join(1), drive=drive)
    assert result.ok, result
    assert machines.procs[0].wait(timeout=30) == 0, machines.output(0)
    node_log = machines.output(0)
    # The other machine left its group and joined round 2 with the head: world 2 -> 3.
    assert "rendezvous round 1: world size 2 on 2 machines" in node_log, node_log
    assert "rendezvous round 2: world size 3 on 2 machines" in node_log, node_log
    # A membership change on both machines, not a restart or a failure.
    assert "restarting" not in node_log and "failed" not in node_log, node_log
    assert [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)] == [
        (2, 2), (3, 2)]
    other = f"127.0.0.1 (pid {machines.procs[0].pid})"  # the same name in both rounds
    assert [dict(r.machines) for r in recorder.of(RendezvousCompleted)] == [
        {"127.0.0.1 (head)": 1, other: 1}, {"127.0.0.1 (head)": 2, other: 1}]
    assert result.restarts == 0 and result.resizes == 1
    if not immediate:  # an immediate resize redoes the step in flight since the last commit
        assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_a_machine_joining_a_running_job_regroups_it_at_a_commit(
        baseline, machines, log_dir, recorder, survivors):
    spec = em.JobSpec.create(2, nnodes="1:2", log_dir=log_dir, timeout=120,
                             survivors=survivors)

    def drive(job):
        job.wait_for_commit(3, timeout=120)
        machines.join(1)

    # Slow steps: the machine must arrive (start Python, import torch) mid-training.
    result = run_head(spec, TRAIN, recorder, machines, namespace={"KILL_AT": -1, "PAUSE": 0.4},
                      drive=drive)
    assert result.ok, result
    assert machines.procs[0].wait(timeout=30) == 0, machines.output(0)
    rounds = [(r.world_size, r.nnodes) for r in recorder.of(RendezvousCompleted)]
    assert rounds == [(2, 1), (3, 2)], rounds
    assert result.restarts == 0
    # Left at a commit: no step lost, none run twice. (The regroup clock, first seeing the
    # machine wait after the commit said "leave", once cut the group while that commit was
    # still on its way: it now lets a group leaving at a commit finish it.)
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    # The head's ranks: torch orders the machines by their agents' PIDs, which wrap around.
    head = (0, 1) if recorder.of(RendezvousCompleted)[1].node_rank == 0 else (1, 2)
    assert_stayed(recorder, [head] if survivors else [()])


def test_a_failure_on_another_machine_is_the_notebook_root_cause(machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    cell = textwrap.dedent("""
        import os, time, torch.distributed as dist
        if os.environ["LOCAL_WORLD_SIZE"] == "2" and os.environ["LOCAL_RANK"] == "1":
            raise ValueError("bad shard on the other machine")
        time.sleep(60)
    """)
    result = run_head(spec, cell, recorder, machines, on_open=lambda: machines.join(2))
    assert result.state is em.JobState.FAILED
    failure = result.failure
    assert failure is not None and failure.exc_type == "ValueError", result.failures
    assert "bad shard on the other machine" in failure.headline
    assert machines.procs[0].wait(timeout=30) == 1


def test_a_wrong_token_is_refused_before_anything_starts(machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir, timeout=120)
    cell = "import time\nprint('head up', flush=True)\ntime.sleep(600)\n"
    outcome = {}

    def drive(job):
        while machines.endpoint is None or not recorder.lines(0):
            time.sleep(0.05)
        proc = machines.join(1, token="0" * 32)
        outcome["rc"] = proc.wait(timeout=60)
        job.stop()

    result = run_head(spec, cell, recorder, machines, drive=drive)
    assert result.state is em.JobState.STOPPED
    assert outcome["rc"] == 1
    assert "refused the token" in machines.output(0)
    assert not recorder.of(NodeConnected)
    assert not os.path.exists(machines.tmp_path / "node0-logs")  # it started nothing


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["join", "127.0.0.1:29400"], "no token: run the command the notebook printed"),
        (["join", "127.0.0.1"], "is not HOST:PORT"),
        (["join", "127.0.0.1:29400", "--nproc", "0"], "at least 1 worker"),
    ],
)
def test_join_with_bad_arguments_says_what_to_do(args, fragment):
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "elastic_magic.cli", *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and fragment in done.stderr, done.stderr


def test_a_job_waiting_for_machines_stops_at_once(log_dir, recorder):
    # The join timeout is past pytest's 300 s limit: only a served stop lets this pass.
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=900)
    job = Job(spec, build_payload("x = 1", spec, namespace={})).start()

    def stop_while_waiting(job):
        while not any(isinstance(e, AcceptingNodes) for e in recorder.events):
            time.sleep(0.05)
        time.sleep(1.0)  # well inside torch's join op
        job.stop()

    threading.Thread(target=stop_while_waiting, args=(job,), daemon=True).start()
    result = job.wait(recorder)
    assert result.state is em.JobState.STOPPED
    assert not recorder.of(RendezvousCompleted)


def test_a_machine_leaving_regroups_the_job_without_a_restart(
        baseline, machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir, timeout=120)
    left = {}

    def drive(job):
        while not any(r.world_size == 2 for r in recorder.of(RendezvousCompleted)):
            if job.done:
                return  # it never joined: the assertions below say so
            time.sleep(0.05)
        first_shared = job.last_commit["step"] if job.last_commit else 0
        job.wait_for_commit(first_shared + 3, timeout=120)
        machines.procs[0].send_signal(signal.SIGTERM)  # ours, by PID: a scheduler's notice
        left["rc"] = machines.procs[0].wait(timeout=60)

    # Slow steps: the machine must arrive (start Python, import torch) mid-training.
    result = run_head(spec, TRAIN, recorder, machines, namespace={"KILL_AT": -1, "PAUSE": 0.4},
                      on_open=lambda: machines.join(1), drive=drive)
    assert result.ok, result
    assert left.get("rc") == 130, machines.output(0)
    worlds = [r.world_size for r in recorder.of(RendezvousCompleted)]
    assert 2 in worlds and worlds[-1] == 1, worlds
    assert [e.connected for e in recorder.of(NodeConnected)] == [True, False]
    assert result.restarts == 0 and result.failures == []
    assert committed_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)


def test_stopping_the_head_ends_every_machine_and_leaves_no_worker(machines, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    cell = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
    ended = {}

    def drive(job):
        while len({e.rank for e in recorder.events if getattr(e, "lines", None)}) < 3:
            time.sleep(0.05)  # all three ranks, both machines, are running the cell
        job.stop()
        ended["rc"] = machines.procs[0].wait(timeout=60)

    result = run_head(spec, cell, recorder, machines, on_open=lambda: machines.join(2),
                      drive=drive)
    assert result.state is em.JobState.STOPPED
    assert ended["rc"] == 0, machines.output(0)
    # Told before its peers vanished: it stopped, it did not fail and restart.
    assert "stopped" in machines.output(0) and "restarting" not in machines.output(0)
    assert not tagged_workers()  # the other machine's workers are gone too
