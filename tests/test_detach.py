"""Training that outlives its kernel (``--detach``): the job's agent runs in a process of its
own; the kernel that started it may restart or be killed, and a kernel of the same user
attaches again, sees the job's story and gets its result. Another user can neither find
nor attach; the detached agent killed outright leaves nothing, and the next job resumes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from conftest import tagged_workers, wait_for_workers, wait_until_no_workers
from jupyter_client.manager import KernelManager
from test_kernel import execute

import elastic_magic
from elastic_magic.agent.handles import attached, detached_agent, detached_folder, detached_launch
from elastic_magic.agent.handles.detached_agent import TAIL_LINES, History
from elastic_magic.agent.node import checkpoint_file
from elastic_magic.wire.events import JobState, Output, StateChanged
from elastic_magic.wire.metrics import Logged
from elastic_magic.wire.payload import build_payload

STEPS = 300

# Each step's data comes from its number: a run resumed anywhere computes what an
# uninterrupted one does. Every rank sees the same data, so DDP's mean gradient is each one's.
TRAIN = """\
import os, time, torch, elastic_magic
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
state = elastic_magic.State(model=model, optimizer=opt, step=0)
while state.step < STEPS:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(state.step))
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", state.step, flush=True)
    state.step += 1
    state.commit(every=2)
    time.sleep(SLEEP)
    while state.step == STEPS - 5 and not os.path.exists(GO):  # the test says when to end
        time.sleep(0.05)
[round(p, 5) for p in torch.cat([q.detach().flatten() for q in model.parameters()]).tolist()]
"""


def training(steps: int, sleep: float, go: Path) -> str:
    return TRAIN.replace("STEPS", str(steps)).replace("SLEEP", str(sleep)).replace(
        "GO", repr(str(go)))


def uninterrupted_parameters() -> list[float]:
    """What the training computes, run here in one process."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [round(p, 5) for p in torch.cat([q.detach().flatten()
                                            for q in model.parameters()]).tolist()]


def last_step(log_dir: Path, run_id: str) -> int:
    """The last step rank 0's logs show (any group's), or -1."""
    steps = [int(m) for path in (log_dir / run_id).glob("group_*/rank_0/stdout.log")
             for m in re.findall(r"^step (\d+)$", path.read_text(), re.M)]
    return max(steps, default=-1)


def wait_for_step(log_dir: Path, run_id: str, step: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (seen := last_step(log_dir, run_id)) < step and time.monotonic() < deadline:
        time.sleep(0.1)
    return seen


@pytest.fixture(autouse=True)
def no_standby():
    """The next detached job's agent that a launch here left ready exits with the test."""
    yield
    detached_launch.drop_standby()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Iterator[Path]:
    """The user's cache (the detached jobs' folder, the logs) for this test alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    # A test that failed half-way leaves its detached job running (it is detached): its
    # agent, which this test's kernel started, stops it and exits on SIGTERM.
    agents = [psutil.Process(c.pid) for c in detached_folder.connections()]
    for agent in agents:
        agent.terminate()
    for agent in psutil.wait_procs(agents, timeout=30)[1]:
        agent.kill()


@pytest.mark.kernel
@pytest.mark.timeout(600)
def test_a_detached_training_outlives_its_kernels_restart_and_kill_and_is_attached_again(
        cache, tmp_path):
    logs = cache / "elastic_magic" / "logs"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        reply, said = execute(kc, "%load_ext elastic_magic")
        assert reply["status"] == "ok", said
        go = tmp_path / "go"
        cell = (f"%%elastic --nproc 2 --detach --bg --text -o job --checkpoint-dir "
                f"{tmp_path / 'ckpt'}\n" + training(STEPS, 0.05, go))
        reply, said = execute(kc, cell)
        assert reply["status"] == "ok", said
        _, said = execute(kc, "print(job.run_id)")
        run_id = said.split()[-1]
        assert wait_for_step(logs, run_id, 5) >= 5
        (connection,) = detached_folder.connections()
        agent = psutil.Process(connection.pid)
        # The kernel keeps the next detached job's agent ready, its warm pool importing.
        (standby,) = [p for p in psutil.Process(km.provisioner.process.pid).children()
                      if "elastic_magic.agent.handles.detached_agent" in p.cmdline()
                      and p.pid != agent.pid]
        deadline = time.monotonic() + 60
        while not standby.children() and time.monotonic() < deadline:
            time.sleep(0.1)
        standby_tree = [standby, *standby.children(recursive=True)]  # with its zygote

        # 1. The notebook's kernel restart (a clean shutdown: the extension unloads, its
        # jobs end... but a detached one only loses its follower).
        kc.stop_channels()
        km.restart_kernel(now=False)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        before = last_step(logs, run_id)
        assert wait_for_step(logs, run_id, before + 3) >= before + 3  # it trains on
        assert agent.is_running() and len(wait_for_workers(2)) == 2
        _, alive = psutil.wait_procs(standby_tree, timeout=30)  # the standby went
        assert alive == [] and len(standby_tree) >= 2  # with its zygote

        # 2. A new kernel attaches (the story so far, then live), then is SIGKILLed.
        execute(kc, "%load_ext elastic_magic")
        reply, said = execute(kc, f"%elastic attach {run_id} --text -o job\n"
                                  "import time; time.sleep(1)")
        assert reply["status"] == "ok", said
        assert "[rank 0] step 0\n" in said  # from before this kernel was born
        kc.stop_channels()
        os.kill(km.provisioner.process.pid, signal.SIGKILL)  # the kernel we started
        km.provisioner.process.wait()
        before = last_step(logs, run_id)
        assert wait_for_step(logs, run_id, before + 3) >= before + 3

        # 3. The kernel started again attaches, waits, and gets the whole run's result.
        ours = agent.children(recursive=True)  # its warm pool, shepherds, workers
        km.restart_kernel(now=True)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        execute(kc, "%load_ext elastic_magic\nimport elastic_magic")
        go.touch()
        reply, said = execute(kc, f"job = elastic_magic.attach({run_id!r})\n"
                                  "result = job.wait()\n"
                                  "print(result.state.value, result.restarts, result.values)",
                              timeout=300)
        assert reply["status"] == "ok", said
        values = uninterrupted_parameters()
        assert f"succeeded 0 {({0: values, 1: values})}" in said
        agent.wait(timeout=30)  # the result was taken: the agent leaves, and all it started
        assert psutil.wait_procs(ours, timeout=10)[1] == []
        assert not list(detached_folder.runtime_folder().iterdir())
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_can_neither_find_nor_attach_and_is_refused_and_logged(tmp_path,
                                                                            monkeypatch):
    cache = Path(f"/tmp/em-detach-{os.getpid()}")  # a path another user can reach
    cache.mkdir(mode=0o711)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    spec = elastic_magic.JobSpec.create(1, detach=True, keep=5, log_dir=tmp_path)
    job = detached_launch.start(spec, build_payload("import time\ntime.sleep(600)", spec))
    folder = detached_folder.runtime_folder()
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        names = {"list": str(folder), "read": str(folder / f"{job.run_id}.json"),
                 "connect": str(folder / f"{job.run_id}.sock")}

        def as_nobody() -> str:
            """What user 65534 may do with the job's folder, files and socket: a forked
            child that drops to that user and only makes system calls."""
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: no Python beyond these calls, then _exit
                said = []
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    for what, act in [
                            ("list", lambda: os.listdir(names["list"])),
                            ("read", lambda: os.close(os.open(names["read"], os.O_RDONLY))),
                            ("connect", lambda: socket.socket(socket.AF_UNIX).connect(
                                names["connect"]))]:
                        try:
                            act()
                            said.append(f"{what} allowed")
                        except OSError as exc:
                            said.append(f"{what} {type(exc).__name__}")
                    os.write(write_end, "\n".join(said).encode())
                finally:
                    os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end) as answer:
                said = answer.read()
            os.waitpid(pid, 0)
            return said

        said = as_nobody()
        assert said.split("\n") == ["list PermissionError", "read PermissionError",
                                    "connect PermissionError"], said
        # Even with the folder and socket opened up (a mistaken chmod), the agent refuses a
        # connection from another user before the handshake, and says so in its log.
        for path in (folder, *folder.parents):
            if path == cache:
                break
            path.chmod(0o711)
        (folder / f"{job.run_id}.sock").chmod(0o666)
        said = as_nobody()
        assert "connect allowed" in said, said
        log = folder / f"{job.run_id}.log"
        deadline = time.monotonic() + 10
        while "refused an attach from user id 65534" not in log.read_text() and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert "refused an attach from user id 65534" in log.read_text()
        assert not job.done  # the job itself runs on
    finally:
        job.stop("the test is over")
        job.wait_done(60)
        shutil.rmtree(cache, ignore_errors=True)


def test_the_detached_agent_killed_leaves_nothing_and_the_next_job_resumes(cache, tmp_path):
    checkpoint = tmp_path / "ckpt"
    spec = elastic_magic.JobSpec.create(2, detach=True, log_dir=tmp_path / "logs",
                                        checkpoint_dir=checkpoint)
    (tmp_path / "go").touch()
    source = training(STEPS, 0.01, tmp_path / "go")
    job = detached_launch.start(spec, build_payload(source, spec))
    assert job.wait_for_commit(6, timeout=120)
    agent = psutil.Process(job.connection.pid)
    ours = [agent, *agent.children(recursive=True)]  # its warm pool, shepherds, workers
    assert len(tagged_workers()) == 2
    agent.kill()
    with pytest.raises(elastic_magic.AgentError, match=r"detached agent .* is gone"):
        job.wait()
    assert wait_until_no_workers(timeout=10) == []
    assert psutil.wait_procs(ours, timeout=10)[1] == []
    assert attached.detached_jobs() == []  # its stale connection file is not listed
    # What the agent had written to disk when it died (the checkpoint follows the commit in
    # memory: commit 6 may not have reached it yet).
    with open(checkpoint / "checkpoint.em", "rb") as file:
        on_disk = checkpoint_file.peek(file)["step"]
    # The standby made for the next job, killed before it had one (the OOM killer, say):
    # its log goes at the next sweep; a living agent's never does, however old.
    standby, folder = detached_launch._standby, detached_folder.runtime_folder()
    assert standby is not None
    log = folder / standby.log
    os.utime(log, (0, 0))
    detached_launch.sweep_logs(folder)
    assert log.exists()
    standby.process.kill()
    deadline = time.monotonic() + 30  # its zygote, which shares its stderr, ends with it
    while log.exists() and time.monotonic() < deadline:
        detached_launch.sweep_logs(folder)
        time.sleep(0.2)
    assert not log.exists()
    # The next job (in the kernel, this time) resumes from the last commit on disk.
    spec = elastic_magic.JobSpec.create(2, log_dir=tmp_path / "logs2",
                                        checkpoint_dir=checkpoint)
    result = elastic_magic.Job(spec, build_payload(source, spec)).start().wait()
    assert result.ok and result.values[0] == uninterrupted_parameters()
    steps = [int(m) for path in (tmp_path / "logs2" / result.run_id).glob(
        "group_*/rank_0/stdout.log") for m in re.findall(r"^step (\d+)$", path.read_text(),
                                                         re.M)]
    assert on_disk >= 2 and min(steps) == on_disk  # from the commit, not from step 0
    assert max(steps) == STEPS - 1


@pytest.mark.unit
def test_a_session_cannot_be_detached_and_says_what_to_do_instead():
    with pytest.raises(elastic_magic.SpecError, match=r"%%elastic --detach"):
        elastic_magic.Session(1, detach=True)


@pytest.mark.unit
def test_an_attaching_kernel_gets_every_event_but_only_the_tail_of_each_ranks_output():
    history = History()
    history.add(StateChanged(JobState.RUNNING))
    for line in range(3 * TAIL_LINES):
        for rank in (0, 1):
            history.add(Output(rank, "stdout", (f"line {line}",), 0))
    history.add(Output(0, "stderr", ("a warning",), 0))
    history.add(StateChanged(JobState.SUCCEEDED))
    events = history.events()
    assert events[0] == StateChanged(JobState.RUNNING, time=events[0].time)
    assert isinstance(events[-1], StateChanged) and events[-1].state is JobState.SUCCEEDED
    lines = {(e.rank, e.stream): [] for e in events if isinstance(e, Output)}
    for event in events:
        if isinstance(event, Output):
            lines[event.rank, event.stream].extend(event.lines)
    assert lines[0, "stdout"] == [f"line {n}" for n in range(2 * TAIL_LINES, 3 * TAIL_LINES)]
    assert lines[1, "stdout"] == lines[0, "stdout"] and lines[0, "stderr"] == ["a warning"]
    assert history.left_out == 2 * 2 * TAIL_LINES  # in the run's logs
    ranks = [e.rank for e in events if isinstance(e, Output) and e.stream == "stdout"]
    assert ranks[:4] == [0, 1, 0, 1]  # in the order they happened


# A "kernel" (a Python process, killed outright below) that starts a detached job on two
# machines (--launcher local: the other one started by the job) and waits.
SEVERAL_MACHINES = """
import sys
import elastic_magic
from elastic_magic.agent.handles import detached_launch
from elastic_magic.wire.payload import build_payload
cell = '''
import os, time, torch.distributed as dist
while not os.path.exists(GO):
    time.sleep(0.05)
(dist.get_rank(), dist.get_world_size(), os.environ.get("ELASTIC_MAGIC_ALLOCATION", "head"))
'''
spec = elastic_magic.JobSpec.create(1, detach=True, nnodes="2", launcher="local",
                                    log_dir=sys.argv[2])
job = detached_launch.start(spec, build_payload(cell, spec,
                                                namespace={"GO": sys.argv[1]}))
print(job.run_id, flush=True)
assert job.wait_for_running(180)
print("running", flush=True)
sys.stdin.read()
"""


@pytest.mark.cluster
def test_a_detached_job_on_several_machines_keeps_them_when_its_kernel_dies(cache, tmp_path):
    go = tmp_path / "go"
    kernel = subprocess.Popen([sys.executable, "-c", SEVERAL_MACHINES, str(go),
                               str(tmp_path / "logs")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout is not None
        run_id = kernel.stdout.readline().strip()
        assert kernel.stdout.readline() == "running\n", run_id
    finally:
        kernel.kill()  # the kernel we started, mid-training
        kernel.wait()
    job = attached.attach(run_id)
    assert job.status()["nnodes"] == 2 and not job.done
    go.touch()
    result = job.wait()
    assert result.ok and result.world_size == 2
    assert sorted(result.values.values()) == [(0, 2, "head"), (1, 2, "local1#1")]


@pytest.mark.unit
def test_an_attaching_kernel_gets_the_newest_logged_points_not_days_of_them(monkeypatch):
    monkeypatch.setattr(detached_agent, "LOGGED", 1000)
    history = History()
    for batch in range(300):  # 3000 points in batches of 10
        history.add(Logged(0, tuple((float(batch), batch * 10 + i, "loss", 1.0)
                                    for i in range(10))))
    history.add(StateChanged(JobState.SUCCEEDED))
    kept = [e for e in history.events() if isinstance(e, Logged)]
    steps = [point[1] for event in kept for point in event.points]
    assert steps == list(range(2000, 3000))  # the newest, in order
    assert isinstance(history.events()[-1], StateChanged)
