"""Shared fixtures. Every worker our tests start inherits a tag, so a leftover process from
this run (and only from this run) can be found in the process table."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

TAG = f"em-test-{uuid.uuid4().hex[:10]}"
os.environ["ELASTIC_MAGIC_TEST_TAG"] = TAG  # inherited by workers and by test kernels
SHEPHERD = "em-shepherd"  # the process name of a rank's shepherd (worker/shepherd.py)
ZYGOTE = "em-zygote"  # the warm pool's process (worker/zygote.py)
SPARE = "em-spare"  # a spare rank's worker until it has a job (worker/spares.py)
ZYGOTE_MODULE = "elastic_magic.worker.zygote"
# The tests' process takes Ctrl-C as a kernel does, also when the suite was started in the
# background (``cmd &`` ignores SIGINT): tests interrupt it. Ranks that inherit an ignored
# SIGINT have a test of their own (test_jobs::test_ranks_take_interrupts_even_where_...).
signal.signal(signal.SIGINT, signal.default_int_handler)


def is_job_process(proc: psutil.Process) -> bool:
    """Started by a job of this test run: it inherits the TORCHELASTIC_RUN_ID the agent
    gives a rank, or was forked by the warm pool's zygote (whose command line it keeps;
    /proc shows the environment a process was exec'd with, the zygote's) and is not one
    of the pool's own (the zygote and its spare ranks, waiting for a job)."""
    env = proc.environ()
    if env.get("ELASTIC_MAGIC_TEST_TAG") != TAG:
        return False
    return "TORCHELASTIC_RUN_ID" in env or (
        ZYGOTE_MODULE in proc.cmdline() and proc.name() != ZYGOTE and not is_spare(proc))


def is_spare(proc: psutil.Process) -> bool:
    """A spare rank of the pool (``worker/spares.py``): its worker, named so until it has
    a job, or that worker's shepherd."""
    if proc.name() == SPARE:
        return True
    children = proc.children() if proc.name() == SHEPHERD else []
    return bool(children) and all(child.name() == SPARE for child in children)


def descriptors() -> list[str]:
    """This process's open descriptors, each as "fd:what it is" (a path, pipe:[inode]...)."""
    found = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed
            found.append(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
    return found


def job_processes() -> list[psutil.Process]:
    """Live processes of this test run that a job started: workers, their shepherds, and
    whatever those started (kernels, servers, browsers and the warm pool's zygote, which
    the tests start or keep between jobs, are not)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and is_job_process(proc):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def tagged_workers() -> list[psutil.Process]:
    """Live worker processes started by this test run: one per rank, the child of its
    shepherd. (Until the shepherd has forked and named itself, a rank has no worker yet:
    counting by command line alone would count the shepherd for a moment.)"""
    workers = []
    for proc in job_processes():
        try:
            if proc.info["name"] != SHEPHERD and proc.parent().name() == SHEPHERD:
                workers.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    return workers


def wait_for_workers(count: int, timeout: float = 60.0) -> list[psutil.Process]:
    """The live workers once there are ``count`` of them (each rank's shepherd has forked
    and named itself, which may come a moment after the rank printed), or what there is
    at ``timeout``: one place that waits for what it counts."""
    deadline = time.monotonic() + timeout
    while len(workers := tagged_workers()) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return workers


def wait_until_no_workers(timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := job_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(autouse=True)
def checkpoint_config(tmp_path_factory, monkeypatch) -> Path:
    """Checkpoint keys are made in a config folder of the test's, never in the real home
    (``elastic_magic.training.checkpoint_key``), and tokens in a cache folder of its own;
    kernels and agents started by the test inherit both."""
    from elastic_magic.training.checkpoint_key import ENV

    config = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    # and a join's token file (elastic_magic.folders.token_folder) lands in the test's too
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv(ENV, raising=False)
    return config


# The tiers of pyproject.toml's markers; a test marked with none of them is a process test.
TIERS = ("unit", "process", "kernel", "browser", "cluster", "gpu", "soak")


# The longest files first: pyproject.toml's `-n 2 --dist loadfile` hands whole files to two
# workers in this order, so neither is left running a long file alone at the end (the
# others follow in collection order). From a run's --durations, longest first.
LONGEST_FIRST = ("test_survivors.py", "test_sharded.py", "test_soak.py", "test_multinode.py",
                 "test_launchers.py", "test_notebooks.py", "test_slurm.py", "test_jobs.py",
                 "test_hangs.py", "test_lost_machines.py", "test_preload.py", "test_session.py",
                 "test_networks.py", "test_dashboard.py", "test_lightning.py",
                 "test_browser.py", "test_pool.py", "test_elastic.py", "test_kernel.py",
                 "test_session_chaos.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.process)
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: in a file too


# A test whose main thread is held in C code never runs pytest-timeout's SIGALRM handler:
# 30 s after its limit, every thread's stack goes to the terminal and its process ends (an
# xdist worker is replaced), so the run goes on and shows where the test was held. Armed
# again for the teardown, as pytest disarms it when a test fails.
HELD_GRACE_S = 30.0
_terminal: list[int] = []  # stderr as it was before capture, duplicated at configure


def pytest_configure(config: pytest.Config) -> None:
    _terminal.append(os.dup(sys.__stderr__.fileno()))


def _watch_for_held(item: pytest.Item) -> None:
    marker = item.get_closest_marker("timeout")
    limit = (marker.kwargs.get("timeout", marker.args[0] if marker.args else None)
             if marker else None)
    if limit is None:
        limit = item.config.getoption("timeout", None) or item.config.getini("timeout")
    faulthandler.dump_traceback_later(float(limit) + HELD_GRACE_S, exit=True,
                                      file=_terminal[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _watch_for_held(item)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _watch_for_held(item)


def _refuse_process(*args: object, **kwargs: object) -> None:
    raise AssertionError("a unit test started a process: mark it `process` (or a higher tier)")


@pytest.fixture(autouse=True)
def unit_tests_start_no_process(request, monkeypatch):
    """A unit test that starts a process fails at once, so the fast lane stays fast and a
    test that belongs to another tier cannot hide in it."""
    if request.node.get_closest_marker("unit") is None:
        return
    import subprocess

    for owner, name in ((os, "fork"), (os, "forkpty"), (os, "posix_spawn"),
                        (os, "posix_spawnp"), (subprocess, "_fork_exec")):
        monkeypatch.setattr(owner, name, _refuse_process)


@pytest.fixture(autouse=True)
def no_leftover_workers(request):
    """After every test the process table holds no worker of ours, nor anything a worker
    started (a unit test starts none: its table is not read)."""
    yield
    if request.node.get_closest_marker("unit") is not None:
        return
    left = wait_until_no_workers(timeout=3.0)
    for proc in left:  # ours by tag; end them so one leak does not cascade
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    assert not left, f"processes left behind: {[(p.pid, p.info['cmdline']) for p in left]}"


# A cell that forks, in every rank, two children that ignore SIGINT and SIGTERM: one stays
# in the worker's process group, one calls setsid() (as a daemon would). Each marks itself
# with an empty file PID_DIR/<pid>.pid once its signals are ignored; the cell waits for both.
FORK_STUBBORN_CHILDREN = """
import os, signal, time

def fork_child(new_session):
    pid = os.fork()
    if pid:
        return pid
    try:  # the child: never returns into the worker's code
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if new_session:
            os.setsid()
        open(os.path.join(PID_DIR, f"{os.getpid()}.pid"), "w").close()
        while True:
            time.sleep(1)
    finally:
        os._exit(0)

kids = [fork_child(False), fork_child(True)]
while not all(os.path.exists(os.path.join(PID_DIR, f"{k}.pid")) for k in kids):
    time.sleep(0.01)
print("children up", flush=True)
"""


# Rank 1 SIGKILLs its shepherd (its parent, checked by name: the shepherd names itself once
# its bare interpreter has started, see shepherd._shed_image) and returns; rank 0 sleeps. Rank
# 1 first stops dying with its shepherd (PR_SET_PDEATHSIG 0): its report pipe then closes
# only when the agent tears the group down and the lifeline closes, so the shepherd's exit is
# the first sign of the rank's end, as when a shepherd is killed from outside just as a cell
# ends (there the worker's pipe closes a few ms after the shepherd's exit).
KILL_OWN_SHEPHERD = """
import ctypes, os, signal, time, torch.distributed as dist
if dist.get_rank() == 1:
    shepherd = os.getppid()
    deadline = time.monotonic() + 10
    while open(f"/proc/{shepherd}/comm").read().strip() != "em-shepherd":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)
    os.kill(shepherd, signal.SIGKILL)
else:
    time.sleep(120)
'done'
"""


def forked_children(pid_dir: Path) -> list[int]:
    return sorted(int(path.stem) for path in pid_dir.glob("*.pid"))


def survivors(pid_dir: Path) -> list[int]:
    """The children that FORK_STUBBORN_CHILDREN marked in ``pid_dir`` and that still run
    (checked by tag too, so a reused PID does not count)."""
    left = []
    for pid in forked_children(pid_dir):
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(
                "ELASTIC_MAGIC_TEST_TAG"
            ) == TAG:
                left.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


@pytest.fixture
def log_dir(tmp_path):
    path = tmp_path / "logs"
    path.mkdir()
    return path


class Recorder:
    """A renderer that keeps every event, for assertions."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, events: list) -> None:
        self.events.extend(events)

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def story(self) -> str:
        """The job's timeline in words, seconds from its first event: a failed assertion's
        message (a string, which pytest shows whole)."""
        from elastic_magic.ui.describe import describe

        start = self.events[0].time if self.events else 0.0
        lines = []
        for event in self.events:
            note = describe(event)
            if note is not None:
                lines.append(f"{event.time - start:7.2f} {note.text}")
        return "\n".join(lines)

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        from elastic_magic.wire.events import Output

        return [
            line for e in self.of(Output) if e.rank == rank and e.stream == stream
            for line in e.lines
        ]


def run_resized(job, recorder, resizes=()):
    """Wait for a started Job, scaling it to each ``(at_step, size)`` of ``resizes`` once
    that step is committed; its result, which must be a success."""
    import threading

    def drive():
        for at_step, size in resizes:
            job.wait_for_commit(at_step, timeout=120)
            job.scale(size)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    result = job.wait(recorder)
    driver.join(timeout=5)
    assert result.ok, (result, result.stacks)  # a hang's: the stuck ranks' stacks
    return result


def assert_stayed(recorder, stayed: list[tuple[int, ...]]) -> None:
    """Each group after the first kept the ranks ``stayed`` (survivors stay), each in a
    process of the group before (a one-shot job's survivor may take another rank when
    machines come and go); every other rank is a new process."""
    import itertools

    from elastic_magic.wire.events import WorkersStarted

    starts = recorder.of(WorkersStarted)
    assert [s.stayed for s in starts[1:]] == stayed
    for before, after in itertools.pairwise(starts):
        old = dict(zip(before.ranks, before.pids, strict=True))
        new = dict(zip(after.ranks, after.pids, strict=True))
        for rank, pid in new.items():
            if rank in after.stayed:
                assert pid in old.values(), (rank, before, after)
            else:
                assert pid not in old.values(), (rank, before, after)


def done_steps(recorder) -> list[int]:
    """The steps rank 0 printed as ``DONE step N ...``, in order."""
    return [int(line.split()[2]) for line in recorder.lines(0) if line.startswith("DONE")]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def ip(request):
    """The real IPython shell (globalipapp) with the extension loaded. Where only unit tests
    of the module use it (``pytest -m unit``), the warm pool is not prewarmed: they start no
    process."""
    from IPython.testing.globalipapp import get_ipython

    import elastic_magic.agent.node.pool as pool

    users = [item for item in request.session.items
             if item.module is request.module and "ip" in item.fixturenames]
    shell = get_ipython()
    with pytest.MonkeyPatch.context() as patch:
        if all(item.get_closest_marker("unit") for item in users):
            patch.setattr(pool, "prewarm", lambda *args, **kwargs: None)
        shell.run_line_magic("load_ext", "elastic_magic")
    yield shell
    shell.run_line_magic("unload_ext", "elastic_magic")
