"""The Slurm launcher against a real Slurm (tests/slurm.py: munged, slurmctld, one slurmd
per network namespace): a training job grows onto allocations as Slurm starts them, gives
one back (it leaves at a commit, then its Slurm job is cancelled), waits with Slurm's own
reason shown, and leaves nothing in the queue, also when the kernel is killed outright; the
token is in no command line and no job field."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
from netns import network as network  # the fixture
from slurm import Slurm, start_slurm
from test_elastic import STEPS, TRAIN, assert_same_parameters, done_steps
from test_elastic import baseline as baseline  # the module-scoped fixture
from test_launchers import (
    PACKAGE_PARENT,
    _in_namespaces,
    _processes_holding,
    end,
    start_head,
    wait_for_status,
)

import elastic_magic as em
from elastic_magic.agent.handles.job import Job
from elastic_magic.events import MachinesChanged, NodeConnected, RendezvousCompleted
from elastic_magic.payload import build_payload


@contextlib.contextmanager
def slurm_cluster(network, tmp_path, monkeypatch) -> Iterator[Slurm]:
    monkeypatch.setenv("PYTHONPATH", PACKAGE_PARENT)  # what sbatch passes on to the jobs
    cluster = start_slurm(network, tmp_path / "slurm", monkeypatch)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def slurm(network, tmp_path, monkeypatch):
    with slurm_cluster(network, tmp_path, monkeypatch) as cluster:
        yield cluster


def options(tmp_path) -> dict[str, str]:
    return {"partition": "test", "time": "10:00", "token_dir": str(tmp_path / "tokens"),
            "workdir": str(tmp_path)}


def _job_fields(slurm, job_ids: list[str]) -> str:
    """What Slurm shows of the jobs: their records, batch scripts and squeue's fields."""
    return "".join(subprocess.run(argv, capture_output=True, text=True,
                                  env=slurm.env()).stdout
                   for job_id in job_ids for argv in (
                       ["scontrol", "show", "job", "-dd", job_id],
                       ["scontrol", "write", "batch_script", job_id, "-"],
                       ["squeue", "--noheader", "--format=%all", f"--jobs={job_id}"]))


@pytest.mark.parametrize("network", [2], indirect=True)
def test_slurm_grows_a_training_job_from_one_machine_to_three_and_gives_one_back(
        baseline, network, slurm, tmp_path, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:3", rdzv_endpoint=network.head_address,
                             launcher="slurm",
                             launch=[f"{k}={v}" for k, v in options(tmp_path).items()],
                             log_dir=log_dir, timeout=60)
    payload = build_payload(TRAIN, spec, namespace={"KILL_AT": -1, "PAUSE": 0.3})
    job = Job(spec, payload).start()
    seen: dict[str, object] = {}

    def watch() -> None:
        status = job._board.wait_for(lambda s: s.nnodes == 3, timeout=120)
        seen["machines"] = status.machines
        seen["holding"] = _processes_holding(job.token or "?")
        job_ids = [line.split()[0] for line in slurm.queue()]
        seen["fields"] = _job_fields(slurm, job_ids)
        seen["token_files"] = [p.stat().st_mode & 0o777
                               for p in (tmp_path / "tokens").iterdir()]
        # Give one back: it leaves at a commit, then its Slurm job is cancelled.
        seen["at"] = job.status_snapshot.last_commit  # where it was, should it fail
        job.scale_nodes(2)
        job._board.wait_for(lambda s: s.nnodes == 2, timeout=120)
        deadline = time.monotonic() + 30
        while len(slurm.queue()) > 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["queue"] = [line.split()[0] for line in slurm.queue()]
        seen["queued"] = job_ids

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = job.wait(recorder)
    watcher.join(timeout=10)
    assert result.ok, (result, slurm.logs())
    sizes = [r.nnodes for r in recorder.of(RendezvousCompleted)]
    assert sizes[0] < 3 and 3 in sizes and sizes[-1] == 2, sizes
    assert result.restarts == 0  # a membership change at a commit, not a failure
    left = [e.reason for e in recorder.of(NodeConnected) if not e.connected]
    assert any("left at a commit: given back to the scheduler" in r for r in left), left
    # The one given back is out of the queue (the other stays while the job runs).
    assert len(seen["queued"]) == 2 and len(seen["queue"]) <= 1, seen
    assert set(seen["queue"]) < set(seen["queued"]), seen
    assert len(seen["machines"]) == 2, seen
    assert all("running on em" in m for m in seen["machines"]), seen
    assert seen["holding"] == [] and job.token not in seen["fields"], seen
    assert "elastic_magic.cli" in seen["fields"]  # the record was read
    assert seen["token_files"] == [0o600]
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    # Nothing left behind: the queue is empty, the token file gone, no join running.
    deadline = time.monotonic() + 30
    while slurm.queue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.queue() == []
    assert list((tmp_path / "tokens").iterdir()) == []
    assert _in_namespaces(network, "elastic_magic.cli") == []


@pytest.mark.parametrize("network", [2], indirect=True)
def test_a_kernel_killed_with_allocations_pending_and_running_leaves_none(
        network, slurm, tmp_path):
    # Three machines asked of a two-node cluster: two run, one waits for Resources.
    head = start_head(network, tmp_path, "slurm", options(tmp_path), nnodes="1:4")
    try:
        status = wait_for_status(head, lambda s: s["nnodes"] == 3 and any(
            "pending (Resources)" in m for m in s["machines"]))
        assert sum("running" in m for m in status["machines"]) == 2, status
        assert len(slurm.queue()) == 3, slurm.queue()
        head.kill()  # SIGKILL: its watchdog cancels what it had
        head.wait()
        deadline = time.monotonic() + 60
        while (slurm.queue() or _in_namespaces(network, "elastic_magic.cli")) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert slurm.queue() == []
        assert _in_namespaces(network, "elastic_magic.cli") == []
        assert list((tmp_path / "tokens").iterdir()) == []
    finally:
        end(head)


@pytest.mark.parametrize("network", [2], indirect=True)
def test_a_preempted_machine_leaves_at_a_commit_and_its_replacement_waits_with_the_reason(
        baseline, network, slurm, tmp_path, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:3", rdzv_endpoint=network.head_address,
                             launcher="slurm",
                             launch=[f"{k}={v}" for k, v in options(tmp_path).items()],
                             log_dir=log_dir, timeout=60)
    payload = build_payload(TRAIN, spec, namespace={"KILL_AT": -1, "PAUSE": 0.3})
    job = Job(spec, payload).start()
    preempted: list[str] = []

    def preempt() -> None:
        # A job of a higher-priority partition takes machine em1: Slurm preempts the
        # allocation there (SIGTERM, then SIGKILL after GraceTime).
        job._board.wait_for(lambda s: s.nnodes == 3, timeout=120)
        subprocess.run(["sbatch", "--partition=urgent", "--nodelist=em1", "--wrap=sleep 8",
                        f"--chdir={tmp_path}"], env=slurm.env(), check=True,
                       capture_output=True)
        # Its replacement waits for em1, with Slurm's reason, while the job goes on smaller
        status = job._board.wait_for(
            lambda s: any(m.startswith("4: pending (") for m in s.machines), timeout=60)
        preempted.append(" ".join(status.machines))

    driver = threading.Thread(target=preempt, daemon=True)
    driver.start()
    result = job.wait(recorder)
    driver.join(timeout=10)
    assert result.ok, (result, slurm.logs())
    assert result.restarts == 0
    assert preempted and "running on em2" in preempted[0], preempted
    left = [e.reason for e in recorder.of(NodeConnected) if not e.connected]
    assert any("left at a commit: its scheduler sent SIGTERM" in r for r in left), left
    sizes = [r.nnodes for r in recorder.of(RendezvousCompleted)]
    assert 2 in sizes[sizes.index(3):], sizes  # it went on smaller
    # A machine that ran in the job and left is no failure to come up: no back-off
    # delays its replacement.
    shown = [line for e in recorder.of(MachinesChanged) for line in e.allocations]
    assert not any("failed in a row" in line for line in shown), shown
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    deadline = time.monotonic() + 30
    while slurm.queue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.queue() == []
