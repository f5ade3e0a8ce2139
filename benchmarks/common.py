"""What the scenarios share: temporary folders, torchrun, timestamps written by ranks."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

import elastic_magic
from elastic_magic.agent.node.pool import warm_pool
from elastic_magic.wire.events import Output


def scratch(prefix: str = "em-bench-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def stamps(folder: Path, prefix: str) -> list[float]:
    """The times ranks wrote into ``folder/<prefix>*``."""
    return [float(path.read_text()) for path in sorted(folder.glob(f"{prefix}*"))
            if not path.name.endswith(".tmp")]


# What the resize, join, leave and cluster cells print once their group formed.
# Each is one f-string, so one write: a mark never splits, whatever comes between two.
_READY = re.compile(r"READY (\d+(?:\.\d+)?) (\d+)(?!\d)")


def ready_stamps(text: str, size: int) -> list[float]:
    """The times of the ``READY <time> <world size>`` marks in ``text`` at world size
    ``size``. Ranks that share a pipe (torchrun's workers all write to its stdout) can
    interleave their lines (``READY t 3READY t 3`` then two newlines: torchrun runs them
    with ``python -u``, where print writes the text and the newline apart), so marks are
    found wherever they are, not as lines."""
    return [float(stamp) for stamp, world in _READY.findall(text) if int(world) == size]


def ready_times(events: list[Any], size: int) -> list[float]:
    """The READY marks at world size ``size`` in a job's output events."""
    return [stamp for event in events if isinstance(event, Output)
            for line in event.lines for stamp in ready_stamps(line, size)]


def free_port() -> int:
    # torchrun and notebook_launcher need their port up front (their way, not ours).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(script: Path, nproc: int, *args: str, env: dict[str, str] | None = None,
             timeout: float = 300, torchrun_args: tuple[str, ...] = (),
             while_running: Callable[[int], object] | None = None) -> None:
    """``torchrun --standalone`` to the end; its own session, killed by PID on timeout.
    ``while_running(pid)``: called with torchrun's PID once it started (its workers are
    its children), before the wait."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", *torchrun_args, str(script), *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        start_new_session=True)
    try:
        if while_running is not None:
            while_running(proc.pid)
        proc.wait(timeout)
    finally:
        kill_torchrun(proc)


def kill_torchrun(proc: subprocess.Popen[Any]) -> None:
    """End a torchrun started in its own session, and its workers: torch starts each in a
    session of its own, which killing torchrun's group does not reach (ours, by PID)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        workers = psutil.Process(proc.pid).children(recursive=True)
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()  # torchrun reaps its workers, or they go to init with it


def launch(cell: str, nproc: int, **options: object) -> elastic_magic.JobResult:
    return elastic_magic.launch(cell, nproc=nproc, render=lambda events: None, **options)


POOL_SETTLES_WITHIN = 300.0  # a rebuild that imports Lightning or transformers, loaded


def settle_pool() -> None:
    """Wait until the warm pool builds no successor: a cell that taught it modules starts
    one in the background. A timed run beside the build would share the CPUs with it
    (whichever side runs then) and fork from the zygote that lacks them."""
    if not warm_pool().wait_rebuilt(POOL_SETTLES_WITHIN):
        raise RuntimeError(f"the warm pool's rebuild took over {POOL_SETTLES_WITHIN:.0f} s")


def warm_up(cell: str, nproc: int, **options: object) -> elastic_magic.JobResult:
    """Run ``cell`` once untimed, as a user's earlier cell (what is timed is a cell after
    the first), and wait for what it taught the pool."""
    result = launch(cell, nproc, **options)
    settle_pool()
    return result


def now() -> float:
    return time.time()
