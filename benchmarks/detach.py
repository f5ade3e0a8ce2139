"""What ``--detach`` costs, and how fast a kernel catches up with a detached job.

- detach_launch: a launch's ranks up (the gloo group made), detached (``elastic_magic``:
  the agent in a process of its own, the standby the detached launch before left ready)
  beside the agent in the kernel (warm: a cell after the first) and torchrun;
- detach_recovery: from rank 1's exit to every rank of the next attempt in user code, in
  the kernel and detached;
- attach: a detached job whose 2 ranks printed 1M lines (100k with --quick): from
  ``attach()`` to a dashboard that is current (every event so far applied to its state).
"""

from __future__ import annotations

import textwrap
import time

import elastic_magic
from elastic_magic.agent.handles import attached, detached_launch
from elastic_magic.agent.handles.handle import next_batch
from elastic_magic.ui.dashboard_state import DashboardState

from .common import launch, now, scratch, stamps, warm_up
from .launch import RECOVERY, USER_CODE, _torchrun

# Prints its share of the lines, says so, then waits to be stopped (an attached kernel
# meets a job that still runs, as a user does).
PRINTS = textwrap.dedent("""
    import os, sys, time
    for i in range(LINES // int(os.environ["WORLD_SIZE"])):
        print("line", i)
    sys.stdout.flush()
    open(os.path.join(OUT, "printed" + os.environ["RANK"]), "w").close()
    time.sleep(600)
""")


def _detached(cell: str, nproc: int, **options: object) -> elastic_magic.JobResult:
    return launch(cell, nproc, detach=True, **options)


def detach_launch(nproc: int, quick: bool) -> dict[str, float]:
    """Each side a cell after the first: the kernel's pool is warm, and the detached job's
    agent is the standby that the detached cell before left, torchrun's seconds earlier (a
    user's next cell does not come sooner)."""
    warm_up("1", nproc)
    _detached("1", nproc)
    times = {}
    out = scratch()
    started = now()
    launch(USER_CODE, nproc, namespace={"OUT": str(out)}, init_process_group=False)
    times["in_kernel"] = max(stamps(out, "up")) - started
    out, started = _torchrun(nproc, USER_CODE)
    times["torchrun"] = max(stamps(out, "up")) - started
    out = scratch()
    started = now()
    _detached(USER_CODE, nproc, namespace={"OUT": str(out)}, init_process_group=False)
    times["elastic_magic"] = max(stamps(out, "up")) - started
    return times


def detach_recovery(nproc: int, quick: bool) -> dict[str, float]:
    times = {}
    for side, run in (("in_kernel", launch), ("elastic_magic", _detached)):
        out = scratch()
        run(RECOVERY, nproc, namespace={"OUT": str(out)}, max_restarts=1,
            init_process_group=False)
        times[side] = max(stamps(out, "up1_")) - stamps(out, "exit")[0]
    return times


def attach(nproc: int, quick: bool) -> dict[str, float]:
    lines = 100_000 if quick else 1_000_000
    out = scratch()
    spec = elastic_magic.JobSpec.create(2, detach=True, keep=60)
    from elastic_magic.wire.payload import build_payload

    first = detached_launch.start(spec, build_payload(PRINTS, spec, namespace={
        "OUT": str(out), "LINES": lines}))
    first.detach()  # as a kernel that was restarted
    deadline = time.monotonic() + 600
    while len(list(out.glob("printed*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the last lines reach the agent
    started = time.perf_counter()
    job = attached.attach(first.run_id)
    state = DashboardState(job.run_id, str(job.log_dir), job.spec.max_restarts)
    for event in next_batch(job.events, wait=False):
        state.apply(event)
    state.traits()
    took = time.perf_counter() - started
    shown = state.shown_lines(0)
    assert shown and shown[-1][1].rstrip("\n").endswith(f"line {lines // 2 - 1}"), shown[-3:]
    job.stop("the benchmark is over")
    job.wait_done(60)
    return {"elastic_magic": took}
