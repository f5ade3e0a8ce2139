"""A machine joins a running job: from starting its agent to every rank of the larger world
running user code. Both sides on loopback, one worker per machine, 1 -> 2 machines.

- elastic_magic: the head runs a 1-worker cell with an elastic State (``--nnodes 1:2``,
  commits every ~50 ms); the second machine runs ``elastic-magic join``. The group leaves
  at the next commit and re-forms with both machines.
- torchrun: ``torchrun --nnodes 1:2 --rdzv-backend c10d`` on the first machine, the same
  command on the second; torch's waiting-node mechanism restarts the first machine's
  workers. Run as torch ships it, and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: in torch
  2.13 a machine that joins after the first round waits for the shared store's address,
  which torch publishes only in the first round (we measured this; see the report).

torchrun as shipped hangs here (3 of 3 in an earlier run): only the unshared-store variant
is run.
"""

from __future__ import annotations

import os
import queue
import shlex
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import WorkersStarted
from elastic_magic.wire.payload import build_payload

from .common import free_port, kill_torchrun, ready_stamps, ready_times
from .elastic import RESIZE_CELL

# The resize benchmark's cell: a State committed every ~50 ms, READY <time> <world size>.
CELL = RESIZE_CELL

TORCHRUN_SCRIPT = textwrap.dedent("""
    import time, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    print(f"READY {time.time()} {dist.get_world_size()}", flush=True)
    while True:
        time.sleep(0.05)
        dist.barrier()
""")
HANG = 60.0  # seconds without every rank up: counted as a hang


def join_command_parts(command: str) -> tuple[str, str]:
    """(HOST:PORT, the token file) of the join command a head shows, ``elastic-magic join
    HOST:PORT --token-file PATH``."""
    words = shlex.split(command)
    if len(words) != 5 or words[:2] != ["elastic-magic", "join"] or words[3] != "--token-file":
        raise ValueError(f"not a join command with a token file: {command!r}")
    return words[2], words[4]


def start_joiner(command: str) -> subprocess.Popen[bytes]:
    """Run the head's join command as another machine would, with one worker."""
    endpoint, token_file = join_command_parts(command)
    return subprocess.Popen(
        [sys.executable, "-m", "elastic_magic.cli", "join", endpoint, "--token-file",
         token_file, "--nproc", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def elastic_join() -> tuple[float, float]:
    """(the join command -> every rank running at world size 2, the new group's workers
    started -> running)."""
    spec = JobSpec.create(1, nnodes="1:2")
    job = Job(spec, build_payload(CELL, spec)).start()
    stamps: list[float] = []
    started: list[float] = []
    regrouped: list[float] = []
    joiner: list[subprocess.Popen[bytes]] = []

    def render(events: list) -> None:
        stamps.extend(ready_times(events, 2))
        regrouped.extend(event.time for event in events if isinstance(event, WorkersStarted)
                         and started and event.time > started[0])

    def drive() -> None:
        command = job.wait_for_join_command(timeout=60)
        assert command is not None
        job.wait_for_commit(5, timeout=120)
        started.append(time.time())
        joiner.append(start_joiner(command))
        deadline = time.monotonic() + HANG
        while len(stamps) < 2 and time.monotonic() < deadline and not job.done:
            time.sleep(0.02)
        job.stop("benchmark done")

    threading.Thread(target=drive, daemon=True).start()
    job.wait(render)
    for proc in joiner:
        proc.wait(timeout=60)
    if len(stamps) < 2 or not regrouped:
        return float("nan"), float("nan")
    return max(stamps) - started[0], max(stamps) - regrouped[0]


def torchrun_join(share_store: bool) -> float:
    folder = Path(tempfile.mkdtemp(prefix="em-bench-join-"))
    script = folder / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    port = free_port()
    env = dict(os.environ)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    lines: queue.Queue[str] = queue.Queue()

    def start() -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
             "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id=bench-{port}", "--rdzv-conf=last_call_timeout=1",
             "--max-restarts=3", "--monitor-interval=0.1", str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
            start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        return proc

    def wait_ready(size: int, count: int) -> float:
        stamps: list[float] = []
        while len(stamps) < count:
            stamps += ready_stamps(lines.get(timeout=HANG), size)
        return max(stamps)

    first = start()
    second = None
    try:
        wait_ready(1, 1)
        time.sleep(0.5)
        started = time.time()
        second = start()
        return wait_ready(2, 2) - started
    except queue.Empty:
        return float("nan")
    finally:
        for proc in (first, second):
            if proc is not None:
                kill_torchrun(proc)


def join(nproc: int, quick: bool) -> dict[str, float]:
    total, beyond_start = elastic_join()
    return {"elastic_magic": total, "elastic_magic_started_to_running": beyond_start,
            "torchrun_unshared_store": torchrun_join(share_store=False)}
