"""A machine is lost from a running job: from the loss to the head's rank running user code
again in the smaller world. Both sides on loopback, one worker per machine, 2 -> 1 machines.

- killed: the joined machine's agent is SIGKILLed (its link closes without a Leaving).
- frozen: the agent and all its processes are SIGSTOPped (a stand-in for a cut link: only the
  missing heartbeats tell), with ``--link-timeout 2``.

Each run reports: detected (the loss -> the head names the machine), regrouped (the loss ->
the smaller group's workers started), running (the loss -> the rank runs user code again),
and beyond_start (workers started -> running: the workers' own start, the part that is not
ours). Before heartbeats and the rendezvous clean-up, a kill cost about 16 s of waiting for
torch's rendezvous heartbeat to expire, and a frozen machine went unnoticed until the
collective timeout.

A scenario of the harness: ``python -m benchmarks --only leave``.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import psutil

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Excluded, Output, WorkersStarted
from elastic_magic.wire.payload import build_payload

from .common import ready_times
from .elastic import RESIZE_CELL
from .join import start_joiner

HANG = 60.0


def lose(how: str) -> dict[str, float]:
    spec = JobSpec.create(1, nnodes="1:2", link_timeout=2)
    job = Job(spec, build_payload(RESIZE_CELL, spec)).start()
    seen: dict[str, float] = {}
    lost_at: list[float] = []
    joiner: list[subprocess.Popen[bytes]] = []
    frozen: list[psutil.Process] = []

    def render(events: list) -> None:
        for event in events:
            after = bool(lost_at) and event.time >= lost_at[0]
            if isinstance(event, Output) and after and "running" not in seen:
                if stamps := ready_times([event], 1):
                    seen["running"] = stamps[0]
            elif isinstance(event, Excluded) and "detected" not in seen:
                seen["detected"] = event.time
            elif isinstance(event, WorkersStarted) and after and "started" not in seen:
                seen["started"] = event.time

    def drive() -> None:
        command = job.wait_for_join_command(timeout=60)
        assert command is not None
        joiner.append(start_joiner(command))
        deadline = time.monotonic() + HANG
        while (job.last_commit or {}).get("world_size") != 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # a few shared commits
        agent = psutil.Process(joiner[0].pid)
        targets = [agent] if how == "killed" else [agent, *agent.children(recursive=True)]
        lost_at.append(time.time())
        for proc in targets:  # ours, by PID
            proc.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        frozen.extend(targets if how == "frozen" else [])
        while "running" not in seen and time.monotonic() < deadline + HANG and not job.done:
            time.sleep(0.02)
        job.stop("benchmark done")

    threading.Thread(target=drive, daemon=True).start()
    try:
        job.wait(render)
    finally:
        for proc in reversed(frozen):
            proc.send_signal(signal.SIGCONT)
        for popen in joiner:
            popen.wait(timeout=60)
    if not lost_at or "running" not in seen:
        return {}
    return {"detected": seen["detected"] - lost_at[0],
            "regrouped": seen["started"] - lost_at[0],
            "running": seen["running"] - lost_at[0],
            "beyond_start": seen["running"] - seen["started"]}


def leave(nproc: int, quick: bool) -> dict[str, float]:
    """Seconds from a machine's loss: to the smaller group's workers started (the regroup,
    what the goal bounds beyond the workers' own start), and to running again; killed, and
    frozen (only the missing heartbeats tell)."""
    killed, frozen = lose("killed"), lose("frozen")
    nan = float("nan")
    return {"elastic_magic_killed_to_started": killed.get("regrouped", nan),
            "elastic_magic_started_to_running": killed.get("beyond_start", nan),
            "elastic_magic_killed_detected": killed.get("detected", nan),
            "elastic_magic_frozen_detected": frozen.get("detected", nan),
            "elastic_magic_frozen_to_running": frozen.get("running", nan)}
