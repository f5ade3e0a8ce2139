"""Growing onto a Slurm cluster: from asking for one more machine to its ranks training.

The cluster is the tests' (tests/slurm.py on tests/netns.py: Debian's munged and slurmctld,
one slurmd in a network namespace of its own address, so the allocation lands on another
"machine"); root only. The head (this process) trains the resize benchmark's cell, a State
committed every ~50 ms that prints ``READY <time> <world size>`` once each group formed,
with ``--nnodes 1:2`` and one worker per machine. Both sides time from the request to the
last rank printing READY at world size 2 (its first step at the new size):

- elastic_magic: ``--launcher slurm``. The launcher asks for MAX machines at once, so the
  job first grows to 2 and is scaled back to 1 (its allocation cancelled, the node idle
  again); then ``scale_nodes(2)`` is timed: sbatch, Slurm starting the allocation, the
  join, the regroup at the next commit.
- by hand: the same job without a launcher, and ``sbatch examples/slurm/join.sbatch
  ENDPOINT`` (the docs' hand-written script running ``elastic-magic join``, the token in
  a 0600 file) submitted while it runs.

Both sides run on the same cluster, one after the other (which goes first alternates from
one repeat to the next).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import NodeConnected
from elastic_magic.wire.payload import build_payload

from .common import ready_times, scratch
from .elastic import RESIZE_CELL
from .join import join_command_parts

ROOT = Path(__file__).resolve().parents[1]
HAND_SCRIPT = ROOT / "examples" / "slurm" / "join.sbatch"
HANG = 120.0  # seconds without the larger group training: counted as failed (nan)
_runs = [0]  # calls so far: the sides alternate which goes first


def _test_machinery() -> tuple[Any, Any]:
    """The tests' netns and slurm modules (tests/ is not a package: its modules import each
    other by name), imported only when this scenario runs."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import netns
    import slurm

    return netns, slurm


@contextlib.contextmanager
def _cluster(folder: Path) -> Iterator[tuple[Any, Any]]:
    """One namespace machine with a slurmd, the clients pointed at it; what sbatch passes
    on to the jobs (PYTHONPATH: this tree's elastic_magic; PATH: this venv's
    elastic-magic) set in this process's environment, all restored afterwards."""
    netns, test_slurm = _test_machinery()
    reason = netns.unavailable() or test_slurm.unavailable()
    if reason:
        raise RuntimeError(f"the cluster benchmark needs the tests' Slurm: {reason}")
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PYTHONPATH", "PATH")}
    with netns.Network(1, folder) as network:
        cluster = test_slurm.Slurm(network, folder / "slurm")
        try:
            env = cluster.start()
            os.environ["SLURM_CONF"] = env["SLURM_CONF"]
            os.environ["PYTHONPATH"] = str(ROOT)
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                                  os.environ.get("PATH", "")])
            yield network, cluster
        finally:
            cluster.close()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _ready_at(events: list, size: int, after: float) -> float | None:
    """When the last of ``size`` ranks printed READY at world size ``size``, after
    ``after``; None until all have."""
    stamps = [stamp for stamp in ready_times(events, size) if stamp > after]
    return max(stamps) if len(stamps) >= size else None


def _connected_at(events: list, after: float) -> float | None:
    """When a machine's join connected to the head, after ``after``."""
    return next((e.time for e in events if isinstance(e, NodeConnected) and e.connected
                 and e.time > after), None)


def _figures(events: list, asked: float) -> tuple[float, float]:
    """(asked -> the larger group training, asked -> the machine's join connected)."""
    if not _until(lambda: _ready_at(list(events), 2, asked)):
        return math.nan, math.nan
    ready, connected = _ready_at(list(events), 2, asked), _connected_at(list(events), asked)
    assert ready is not None
    return ready - asked, (connected - asked) if connected is not None else math.nan


def _run_job(spec: JobSpec, drive: Callable[[Job, list], tuple[float, float]]
             ) -> tuple[float, float]:
    """The training job, ``drive`` on a thread (it returns the figures), then stopped."""
    job = Job(spec, build_payload(RESIZE_CELL, spec)).start()
    events: list = []
    figure: list[tuple[float, float]] = []

    def driver() -> None:
        try:
            figure.append(drive(job, events))
        finally:
            job.stop("benchmark done")

    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    job.wait(events.extend)
    thread.join(timeout=60)
    return figure[0] if figure else (math.nan, math.nan)


def _until(check: Callable[[], object], timeout: float = HANG) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _step(job: Job) -> int:
    commit = job.status_snapshot.last_commit
    return int(commit["step"]) if commit else 0


def launcher_side(network: Any, cluster: Any, folder: Path
                  ) -> tuple[float, float]:
    options = {"partition": "test", "time": "10:00", "token_dir": str(folder / "tokens"),
               "workdir": str(folder), "nproc": "1"}
    spec = JobSpec.create(1, nnodes="1:2", rdzv_endpoint=network.head_address,
                          launcher="slurm", launch=[f"{k}={v}" for k, v in options.items()],
                          log_dir=folder / "logs-launcher", timeout=60)

    def drive(job: Job, events: list) -> tuple[float, float]:
        # it asked for its MAX at once: grown, then given back, the node idle again
        if not _until(lambda: _ready_at(list(events), 2, 0)):
            return math.nan, math.nan
        shrunk = time.time()
        job.scale_nodes(1)
        if not (_until(lambda: _ready_at(list(events), 1, shrunk)) and
                _until(lambda: not cluster.queue()) and _until(cluster.idle)):
            return math.nan, math.nan
        job.wait_for_commit(_step(job) + 5, timeout=60)  # training at size 1, as by hand
        asked = time.time()
        job.scale_nodes(2)
        return _figures(events, asked)

    return _run_job(spec, drive)


def by_hand_side(network: Any, cluster: Any, folder: Path
                  ) -> tuple[float, float]:
    spec = JobSpec.create(1, nnodes="1:2", rdzv_endpoint=network.head_address,
                          log_dir=folder / "logs-hand", timeout=60)
    submitted: list[str] = []

    def drive(job: Job, events: list) -> tuple[float, float]:
        command = job.wait_for_join_command(timeout=60)
        assert command is not None
        # the docs' script takes the endpoint as its argument, the token file from the
        # environment
        endpoint, token_file = join_command_parts(command)
        # the node idle (the other side's allocation may still be completing), training
        if not (_until(lambda: not cluster.queue()) and _until(cluster.idle)):
            return math.nan, math.nan
        job.wait_for_commit(_step(job) + 5, timeout=60)
        asked = time.time()
        done = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--partition=test", f"--chdir={folder}",
             str(HAND_SCRIPT), endpoint], capture_output=True, text=True, check=True,
            env={**os.environ, "ELASTIC_MAGIC_TOKEN_FILE": token_file, "NPROC": "1"})
        submitted.append(done.stdout.strip().split(";")[0])
        return _figures(events, asked)

    try:
        return _run_job(spec, drive)
    finally:
        for job_id in submitted:  # the join left with the job; this is in case it did not
            subprocess.run(["scancel", job_id], capture_output=True)
        _until(lambda: not cluster.queue(), timeout=60)


def cluster_grow(nproc: int, quick: bool) -> dict[str, float]:
    """(One worker per machine whatever --nproc or --quick: the figure is the machine's
    arrival.) ``_connected``: to the machine's join reaching the head (the scheduler and
    the interpreter's start), the rest being the regroup."""
    folder = scratch("em-bench-cluster-")
    folder.chmod(0o755)  # the jobs' working directory (they run as this user anyway)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, ignore_errors=True)
        network, cluster = stack.enter_context(_cluster(folder))
        _runs[0] += 1
        if _runs[0] % 2:
            launched, launched_connected = launcher_side(network, cluster, folder)
            by_hand, by_hand_connected = by_hand_side(network, cluster, folder)
        else:
            by_hand, by_hand_connected = by_hand_side(network, cluster, folder)
            launched, launched_connected = launcher_side(network, cluster, folder)
    return {"elastic_magic": launched, "sbatch_join_by_hand": by_hand,
            "elastic_magic_connected": launched_connected,
            "sbatch_join_by_hand_connected": by_hand_connected}
