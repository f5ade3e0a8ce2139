"""The Slurm launcher against a real Slurm (tests/slurm.py: munged, slurmctld, one slurmd
per network namespace): a training job grows onto allocations as Slurm starts them, gives
one back (it leaves at a commit, then its Slurm job is cancelled), waits with Slurm's own
reason shown, and leaves nothing in the queue, also when the kernel is killed outright (or
interrupted, or killed, while sbatch submits) or scancel times out; the token is in no
command line and no job field."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

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
from elastic_magic.launchers import JoinRequest, make_launcher
from elastic_magic.launchers.cluster import Cluster
from elastic_magic.wire.events import MachinesChanged, NodeConnected, RendezvousCompleted
from elastic_magic.wire.payload import build_payload

pytestmark = pytest.mark.cluster


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
            "workdir": str(tmp_path), "output_dir": str(tmp_path / "output")}


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


# -- what the notebook's folder holds, and what a job prints there --------------------------


def _one_join(slurm, tmp_path, workdir) -> list:
    """One join submitted from ``workdir`` to an endpoint it refuses at once (``join``
    exits 2), once it ended: the files of the launcher's output folder named for it."""
    from elastic_magic.launchers import JoinRequest, make_launcher

    launcher = make_launcher("slurm", {**options(tmp_path), "workdir": str(workdir)})
    try:
        allocation = launcher.start(JoinRequest("not-an-endpoint", "token", "em-planted"))
        deadline = time.monotonic() + 120
        while launcher.allocations()[0].state != "ended":
            assert time.monotonic() < deadline, (launcher.allocations(), slurm.logs())
            time.sleep(0.2)
    finally:
        launcher.cancel_all()
    return list((tmp_path / "output").glob(f"elastic-em-planted*-{allocation.id}.out"))


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_job_on_a_node_runs_nothing_planted_in_the_start_folder_through_pythonpath(
        network, slurm, tmp_path, monkeypatch):
    """sbatch gives the job the kernel's environment and folder: with ``PYTHONPATH=":lib:..."``
    (an empty and a relative entry, which Python turns into the job's folder and one in it),
    an ``elastic_magic/__init__.py`` planted in a group-writable notebook folder ran as the
    user on the node. The join runs its own elastic_magic, and nothing of the folder's."""
    start, marker = tmp_path / "start", tmp_path / "marker"
    for folder in (start, start / "lib"):
        (folder / "elastic_magic").mkdir(parents=True)
        for planted in (folder / "elastic_magic" / "__init__.py", folder / "sitecustomize.py"):
            planted.write_text(f"open({str(marker)!r}, 'a').write(__file__ + '\\n')\n")
    start.chmod(0o775)
    monkeypatch.setenv("PYTHONPATH", f":lib:{PACKAGE_PARENT}")  # what sbatch passes on
    (printed,) = _one_join(slurm, tmp_path, start)
    assert not marker.exists(), marker.read_text()
    assert "'not-an-endpoint' is not HOST:PORT" in printed.read_text()  # the join ran there


@pytest.mark.parametrize("network", [1], indirect=True)
def test_what_a_job_prints_goes_to_a_private_folder_not_the_working_folder(
        network, slurm, tmp_path):
    """Slurm writes a job's output to ``slurm-%j.out`` in its working folder, with the
    user's umask (0644 under 022): a joined machine's ranks' lines, for others to read.
    It goes to a file of the launcher's 0700 output folder instead."""
    import os
    import stat

    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    old = os.umask(0o022)  # sbatch hands the job its submitter's umask
    try:
        printed = _one_join(slurm, tmp_path, work)
    finally:
        os.umask(old)
    assert list(work.iterdir()) == []  # no slurm-*.out
    assert len(printed) == 1 and "is not HOST:PORT" in printed[0].read_text()  # both streams
    output = tmp_path / "output"
    assert stat.S_IMODE(output.stat().st_mode) == 0o700
    assert output.stat().st_uid == os.getuid()
    assert [p.name for p in output.iterdir()] == [p.name for p in output.glob("elastic-*.out")]


# -- a kernel that dies or is interrupted while sbatch submits; scancel that times out ------


class Gate:
    """Where a wrapper script tells the test how far it got (``tell``, ``reach``: told,
    then waits for ``open``), through two FIFOs the test holds open."""

    def __init__(self, folder: Path) -> None:
        self.said, self.go = folder / "said", folder / "go"
        os.mkfifo(self.said)
        os.mkfifo(self.go)
        self._said = os.open(self.said, os.O_RDONLY | os.O_NONBLOCK)
        self._writer = os.open(self.said, os.O_WRONLY)  # no end of file between scripts
        self._go = os.open(self.go, os.O_RDWR)  # the script's open does not wait for it
        self._pending = b""

    def shell(self) -> str:
        said, go = shlex.quote(str(self.said)), shlex.quote(str(self.go))
        return (f'tell() {{ echo "$*" > {said}; }}\n'
                f'reach() {{ tell "$@"; read go < {go}; }}\n')

    def heard(self, timeout: float = 120) -> str:
        """The next line a script told."""
        while b"\n" not in self._pending:
            assert select.select([self._said], [], [], timeout)[0], "no script told anything"
            self._pending += os.read(self._said, 1 << 10)
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def open(self) -> None:
        os.write(self._go, b"go\n")

    def close(self) -> None:
        for fd in (self._said, self._writer, self._go):
            os.close(fd)


@pytest.fixture
def tools(tmp_path, monkeypatch) -> Iterator[tuple[Path, Gate]]:
    """A folder first on PATH for wrappers of Slurm's tools (``wrap``), and their Gate."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    gate = Gate(tmp_path)
    try:
        yield folder, gate
    finally:
        gate.close()


def wrap(tools: tuple[Path, Gate], tool: str, body: str) -> None:
    """``tool`` on PATH runs ``body`` (``$REAL``: the real one) after the Gate's functions."""
    folder, gate = tools
    real = shutil.which(tool, path=os.environ["PATH"].split(":", 1)[1])
    assert real is not None
    (folder / tool).write_text(f"#!/bin/sh\nREAL={shlex.quote(real)}\n{gate.shell()}{body}")
    (folder / tool).chmod(0o755)


def failing_scancel(tools: tuple[Path, Gate], folder: Path) -> Path:
    """scancel, logging its arguments, that fails as a busy controller does while the
    returned file holds a count above 0 (each failure takes one off)."""
    left, log = folder / "scancel-failures", folder / "scancel.log"
    left.write_text("0")
    wrap(tools, "scancel", textwrap.dedent(f"""\
        echo "$*" >> {shlex.quote(str(log))}
        left=$(cat {shlex.quote(str(left))})
        if [ "$left" -gt 0 ]; then
            echo $((left - 1)) > {shlex.quote(str(left))}
            echo "scancel: error: Socket timed out on send/recv operation" >&2
            exit 1
        fi
        exec "$REAL" "$@"
    """))
    return left


def wait_until(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def held(tmp_path) -> dict[str, str]:
    """The launcher's options, its jobs held (they wait, JobHeldUser, until cancelled)."""
    return {**options(tmp_path), "sbatch_options": "--hold"}


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_kernel_killed_while_sbatch_submits_leaves_no_job_and_no_token_file(
        network, slurm, tools, tmp_path):
    _, gate = tools
    # sbatch has the batch script, then waits before it submits, then says what it did.
    wrap(tools, "sbatch", 'script=$(cat)\nreach submitting\n'
                          'out=$(printf "%s\\n" "$script" | "$REAL" "$@")\n'
                          'tell "submitted $out"\necho "$out"\n')
    head = start_head(network, tmp_path, "slurm", held(tmp_path), nnodes="1:2")
    try:
        assert gate.heard() == "submitting"
        assert [p.name for p in (tmp_path / "tokens").iterdir()] != []  # written first
        head.kill()  # SIGKILL, while sbatch runs
        head.wait()
        gate.open()  # it submits now, the kernel gone
        job_id = gate.heard().split()[1]
        # The watchdog waited for sbatch's end, then cancelled its job by its name.
        wait_until(lambda: slurm.queue() == [], f"job {job_id} left in {slurm.queue()}")
        wait_until(lambda: list((tmp_path / "tokens").iterdir()) == [], "the token file left")
    finally:
        end(head)


HEAD_INTERRUPTED = textwrap.dedent("""
    import json, sys
    import elastic_magic as em
    from elastic_magic.agent.handles.job import Job
    from elastic_magic.wire.payload import build_payload
    spec = em.JobSpec.create(1, nnodes="1:2", rdzv_endpoint=sys.argv[1], launcher="slurm",
                             launch=json.loads(sys.argv[2]), log_dir=sys.argv[3], timeout=60)
    job = Job(spec, build_payload("import time\\nwhile True: time.sleep(0.1)", spec)).start()
    try:
        job.wait()
    except KeyboardInterrupt:  # Ctrl-C: the job stopped, then the cell ends
        print("interrupted", job.status_snapshot.machines, flush=True)
""")


@pytest.mark.parametrize("network", [1], indirect=True)
def test_an_interrupt_while_sbatch_submits_leaves_one_job_tracked_and_then_cancelled(
        network, slurm, tools, tmp_path):
    _, gate = tools
    submitted = tmp_path / "submitted"
    failing_scancel(tools, tmp_path)  # fails none: it logs what it cancels
    # sbatch submits, then waits before it says the job's id (an interrupt meanwhile
    # would have killed it, and with it the only record of the job).
    wrap(tools, "sbatch", f'out=$("$REAL" "$@") || exit $?\n'
                          f'echo "$out" >> {shlex.quote(str(submitted))}\n'
                          'reach "submitted $out"\necho "$out"\n')
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD_INTERRUPTED, network.head_address,
         json.dumps([f"{k}={v}" for k, v in held(tmp_path).items()]),
         str(tmp_path / "head-logs")],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    try:
        job_id = gate.heard().split()[1]
        os.killpg(head.pid, signal.SIGINT)  # Jupyter's interrupt: the kernel's whole group
        gate.open()
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0 and out.startswith("interrupted"), out
        assert submitted.read_text().split() == [job_id]  # one submission, not a second
        cancels = (tmp_path / "scancel.log").read_text().splitlines()
        assert job_id in cancels, cancels  # the kernel had it: cancelled by its id
        wait_until(lambda: slurm.queue() == [], f"left in the queue: {slurm.queue()}")
        assert list((tmp_path / "tokens").iterdir()) == []
    finally:
        end(head)


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_cancel_slurm_did_not_confirm_is_asked_again_until_it_is(
        network, slurm, tools, tmp_path):
    failures = failing_scancel(tools, tmp_path)
    shown: list[tuple[str, ...]] = []
    cluster = Cluster(make_launcher("slurm", held(tmp_path)),
                      JoinRequest(f"{network.head_address}:1", "token", "em-cancels"),
                      machines=1, publish=shown.append, poll_interval=0.2)
    cluster.start()
    try:
        wait_until(lambda: len(slurm.queue()) == 1, "no job submitted")
        failures.write_text("2")
        cluster.scale(0)  # its waiting job is cancelled: scancel times out twice
        wait_until(lambda: slurm.queue() == [], f"left in the queue: {slurm.queue()}")
        assert failures.read_text().strip() == "0"
        assert any("cancel failed (asking again in 1s): scancel" in line and
                   "Socket timed out" in line for lines in shown for line in lines), shown
        # At the job's end: cancel_all times out, and the watchdog goes on asking.
        cluster.scale(1)
        wait_until(lambda: len(slurm.queue()) == 1, "no job submitted")
        failures.write_text("3")
        cluster.close()
        assert "the scheduler did not confirm every cancel" in shown[-1][0], shown[-1]
        wait_until(lambda: slurm.queue() == [], f"left in the queue: {slurm.queue()}")
        assert cluster.watchdog is not None and cluster.watchdog.proc.wait(timeout=120) == 0
        assert failures.read_text().strip() == "0"
        assert list((tmp_path / "tokens").iterdir()) == []
    finally:
        cluster.close()


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_dead_kernels_watchdog_asks_again_until_slurm_confirms_the_cancel(
        network, slurm, tools, tmp_path):
    failures = failing_scancel(tools, tmp_path)
    head = start_head(network, tmp_path, "slurm", held(tmp_path), nnodes="1:2")
    try:
        wait_for_status(head, lambda s: any("pending (JobHeldUser)" in m
                                            for m in s["machines"]))
        failures.write_text("3")
        head.kill()  # SIGKILL: its watchdog cancels, through three timeouts
        head.wait()
        wait_until(lambda: slurm.queue() == [], f"left in the queue: {slurm.queue()}")
        assert failures.read_text().strip() == "0"
        assert list((tmp_path / "tokens").iterdir()) == []
    finally:
        end(head)


WAIT_FOR_FILE = textwrap.dedent("""
    import os, time
    import torch.distributed as dist
    print("world", dist.get_world_size(), flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(STOP):
        assert time.monotonic() < deadline, "never told to stop"
        time.sleep(0.1)
""")


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_machine_that_comes_up_after_its_unconfirmed_cancel_is_sent_away(
        network, slurm, tools, tmp_path, log_dir, recorder):
    failures = failing_scancel(tools, tmp_path)
    spec = em.JobSpec.create(1, nnodes="1:2", rdzv_endpoint=network.head_address,
                             launcher="slurm",
                             launch=[f"{k}={v}" for k, v in held(tmp_path).items()],
                             log_dir=log_dir, timeout=60)
    stop = tmp_path / "stop"
    job = Job(spec, build_payload(WAIT_FOR_FILE, spec, namespace={"STOP": str(stop)})).start()
    seen: dict[str, object] = {}

    def sent_away() -> list[str]:
        return [e.reason for e in list(recorder.events)
                if isinstance(e, NodeConnected) and not e.connected]

    def watch() -> None:
        try:
            status = job._board.wait_for(lambda s: any("JobHeldUser" in m for m in s.machines),
                                         timeout=120)
            seen["held"] = job_id = status.machines[0].split(":")[0].split()[0]
            failures.write_text("1000")  # no cancel is confirmed from now on
            job.scale_nodes(1)  # its held job is cancelled: scancel times out
            job._board.wait_for(lambda s: any("cancel failed" in m for m in s.machines),
                                timeout=60)
            # Slurm starts it after all: its machine comes up and says Hello.
            subprocess.run(["scontrol", "release", job_id], env=slurm.env(), check=True)
            wait_until(lambda: sent_away() != [], "the machine was never sent away", 120)
            failures.write_text("0")  # now a cancel goes through
            seen["reasons"] = sent_away()
        except BaseException as exc:  # said below, with what the job did
            seen["error"] = repr(exc)
        finally:
            stop.write_text("")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = job.wait(recorder)
    watcher.join(timeout=30)
    sizes = [r.nnodes for r in recorder.of(RendezvousCompleted)]
    assert result.ok and "error" not in seen, (result, seen, sizes, slurm.logs())
    assert seen["reasons"] == [f"its allocation {seen['held']} was given back before it "
                               "came up"], seen
    # It never joined a round: the job ran on the kernel's machine alone throughout.
    assert sizes == [1], recorder.story()
    assert recorder.lines(0) == ["world 1"]
    wait_until(lambda: slurm.queue() == [], f"left in the queue: {slurm.queue()}")
    assert list((tmp_path / "tokens").iterdir()) == []
    assert _in_namespaces(network, "elastic_magic.cli") == []
