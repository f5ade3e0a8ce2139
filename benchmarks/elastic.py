"""Resize latency and commit cost, each beside what a torchrun user does instead.

Resize: from the request to every rank of the new group running user code again.
- elastic_magic: ``job.scale(3)`` on a running 2-worker job with an elastic State (applied
  at the next commit; steps take ~50 ms), and ``job.scale(3, immediate=True)``;
- torchrun: stop the 2-worker torchrun (SIGTERM) and start a 3-worker one that loads the
  last ``torch.save`` checkpoint, the usual way to change the size of a torchrun job
  (NaN: not every rank printed READY at the new size within 60 s).

Commit: one ``state.commit()`` of a ~100 MB model (25M float32 parameters) on 2 ranks,
against ``torch.save`` of the same state_dict to a file with fsync, timed in the same
worker; also with ``--checkpoint-dir`` (the agent writes the checkpoint behind the commit).
"""

from __future__ import annotations

import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.payload import build_payload

from .common import kill_torchrun, launch, ready_stamps, ready_times, scratch

RESIZE_CELL = textwrap.dedent("""
    import time, torch, torch.distributed as dist, elastic_magic
    model = torch.nn.Linear(64, 64)
    state = elastic_magic.State(model=model, step=0)
    dist.barrier()
    print(f"READY {time.time()} {dist.get_world_size()}", flush=True)
    while state.step < 100000:
        time.sleep(0.05)
        state.step += 1
        state.commit()
""")

TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    model = torch.nn.Linear(64, 64)
    ckpt = sys.argv[1]
    if os.path.exists(ckpt):
        model.load_state_dict(torch.load(ckpt))
    dist.barrier()
    print(f"READY {time.time()} {dist.get_world_size()}", flush=True)
    while True:
        time.sleep(0.05)
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
        dist.barrier()
""")

COMMIT_CELL = textwrap.dedent("""
    import os, tempfile, time, torch, torch.distributed as dist, elastic_magic
    model = torch.nn.Linear(5000, 5000)  # 25M float32 parameters: 100 MB
    state = elastic_magic.State(model=model, step=0)
    ours, theirs = [], []
    for _ in range(REPEAT):
        state.step += 1
        t = time.perf_counter(); state.commit(); ours.append(time.perf_counter() - t)
        dist.barrier()
        if dist.get_rank() == 0:
            path = os.path.join(tempfile.gettempdir(), "em-bench-ckpt.pt")
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(model.state_dict(), f); f.flush(); os.fsync(f.fileno())
            theirs.append(time.perf_counter() - t)
            os.remove(path)
        dist.barrier()
    (ours, theirs)
""")


def elastic_resize(immediate: bool) -> float:
    spec = JobSpec.create(2, min_nproc=1, max_nproc=3)
    job = Job(spec, build_payload(RESIZE_CELL, spec)).start()
    events: list = []
    requested: list[float] = []

    def drive():
        job.wait_for_commit(5, timeout=120)
        requested.append(time.time())
        job.scale(3, immediate=immediate)
        while len(ready_times(list(events), 3)) < 3 and not job.done:
            time.sleep(0.02)
        job.stop("benchmark done")

    threading.Thread(target=drive, daemon=True).start()
    job.wait(events.extend)
    return max(ready_times(events, 3)) - requested[0]


def torchrun_resize() -> float:
    folder = Path(tempfile.mkdtemp(prefix="em-bench-"))
    script, ckpt = folder / "train.py", folder / "ckpt.pt"
    script.write_text(TORCHRUN_SCRIPT)

    def start(n: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={n}", str(script), str(ckpt)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)

    def wait_ready(proc: subprocess.Popen[str], n: int) -> float:
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        stamps: list[float] = []
        while len(stamps) < n:
            line = lines.get(timeout=60)  # queue.Empty: no rank up in 60 s: a failure
            stamps += ready_stamps(line, n)
        return max(stamps)

    first = start(2)
    second = None
    try:
        wait_ready(first, 2)
        time.sleep(0.5)  # a few checkpoints written
        requested = time.time()
        os.killpg(first.pid, signal.SIGTERM)
        first.wait()
        second = start(3)
        return wait_ready(second, 3) - requested
    except queue.Empty:
        return float("nan")
    finally:
        for proc in (first, second):
            if proc is not None:
                kill_torchrun(proc)


def _commit_cost(repeat: int, checkpoint_dir: str | None) -> tuple[float, float]:
    """Median seconds of our commit and of torch.save + fsync, the first of each dropped
    (allocator warm-up on both sides)."""
    result = launch(COMMIT_CELL, 2, namespace={"REPEAT": repeat + 1},
                    checkpoint_dir=checkpoint_dir)
    ours, theirs = result.values[0]
    return statistics.median(ours[1:]), statistics.median(theirs[1:])


def resize(nproc: int, quick: bool) -> dict[str, float]:
    return {"elastic_magic": elastic_resize(immediate=False),
            "elastic_magic_immediate": elastic_resize(immediate=True),
            "torchrun_relaunch": torchrun_resize()}


def commit(nproc: int, quick: bool) -> dict[str, float]:
    repeat = 2 if quick else 5
    ours, theirs = _commit_cost(repeat, None)
    with_disk, theirs_again = _commit_cost(repeat, str(scratch("em-bench-ckpt-")))
    return {"elastic_magic": ours, "elastic_magic_checkpoint_dir": with_disk,
            "torch_save_fsync": statistics.median([theirs, theirs_again])}
