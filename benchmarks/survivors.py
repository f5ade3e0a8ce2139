"""Survivors stay (issue 21): recovery as the model grows, and training under failures.

- survivors_model_size: a DDP training with AdamW whose State (parameters and both Adam
  moments) is about 10 MB and about 1 GB (100 MB with ``--quick``), committing every step;
  rank 1 SIGKILLs itself after the second step's commit, and the figure is from the kill to
  the first step again on every rank (as train_recovery_survivors), and from the kill to
  rank 0 (a survivor) ready again with the State rolled back (``_rank0_ready``; it waits
  in the restore's collective for the new rank, which builds the model first); and, with no
  new rank to wait for, 3 ranks shrunk to 2 at a commit: from that commit to rank 0 ready
  again in the smaller group (``_shrunk_ready``). Sides:
  going on in place (``@elastic_magic.run``), ``--survivors`` running the cell again from
  the top, and every rank starting again.
- survivors_efficiency: the DDP training cell (a) of cells.py for 5 minutes (30 s with
  ``--quick``), a rank's worker SIGKILLed from outside every 10 s; the figure is the
  steps in the final committed progress (counted by the training: its step counter at the
  end, which a restore rolls back) over the steps of an undisturbed run of the same side
  in the same time. Sides: going on in place (``@elastic_magic.run``; its undisturbed run
  is the cell's, shared with the next sides), ``--survivors``, every rank starting again,
  and the same script under ``torchrun --max-restarts`` (its own agent), which saves its
  own checkpoint with ``torch.save`` after every step where the cell commits its State.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Committed
from elastic_magic.wire.payload import build_payload

from . import cells
from .common import launch, scratch, torchrun, warm_up
from .training import _recovered

# -- a survivor's recovery as the model grows --------------------------------------------

# 4 square layers of WIDTH; each attempt stamps its first step as ``step<restart count>``.
SIZED_KILLED = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist, elastic_magic
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = elastic_magic.State(model=model, optimizer=optimizer, step=0)
    stamp(f"ready{attempt}w{dist.get_world_size()}")
    x = torch.randn(8, WIDTH)
    first = True
    while state.step < STEPS:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if first:
            stamp(f"step{attempt}")
            first = False
        state.step += 1
        state.commit()  # waits for the commit before: the restore has a whole one either way
        if KILL and attempt == "0" and state.step == 2:
            dist.barrier()
            if dist.get_rank() == 1:
                stamp("kill")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
    dist.destroy_process_group()
""")


# The same going on in place (@elastic_magic.run): a survivor keeps its model and optimizer
# and stamps ``ready<restart count>`` as it enters the function again, rolled back.
SIZED_IN_PLACE = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist, elastic_magic
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4)))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    state = elastic_magic.State(model=net, optimizer=optimizer, step=0)
    x = torch.randn(8, WIDTH)

    @elastic_magic.run
    def train(state):
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        stamp(f"ready{attempt}w{dist.get_world_size()}")
        model = DDP(net)
        first = True
        while state.step < STEPS:
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
            if first:
                stamp(f"step{attempt}")
                first = False
            state.step += 1
            state.commit()
            if KILL and attempt == "0" and state.step == 2:
                dist.barrier()
                if dist.get_rank() == 1:
                    stamp("kill")
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)

    train(state)
    dist.destroy_process_group()
""")


def _width(state_bytes: float) -> int:
    """The layers' width for a State of ``state_bytes``: 4 layers of float32 weights, each
    kept three times (the parameter and Adam's two moments)."""
    return int(math.sqrt(state_bytes / (4 * 4 * 3)))


def survivors_model_size(nproc: int, quick: bool) -> dict[str, float]:
    cells.set_env()
    warm_up(cells.STAMP + cells.MLP, nproc,  # the pool has started and seen a training cell
            namespace=cells.namespace(scratch(), cells.params(quick)))
    sides = {}
    for label, size in (("10mb", 10e6), ("100mb" if quick else "1gb", 1e8 if quick else 1e9)):
        for side, survivors, cell in (("in_place", True, SIZED_IN_PLACE),
                                      ("survivors", True, SIZED_KILLED),
                                      ("restart", False, SIZED_KILLED)):
            out = scratch()
            launch(cells.STAMP + cell, nproc, max_restarts=1, survivors=survivors,
                   namespace=cells.namespace(out, {"WIDTH": _width(size), "KILL": 1,
                                                   "STEPS": 4}))
            name = f"elastic_magic_{side}_{label}"
            sides[name] = _recovered(out, nproc)
            # rank 0 (a survivor, or restarted) ready again, rolled back: it waits for the
            # new rank 1, which builds the model, in the restore's collective
            sides[f"{name}_rank0_ready"] = \
                cells.every(out, f"ready1w{nproc}", nproc)[0] - cells.every(out, "kill", 1)[0]
            # the survivors alone: shrunk by one rank at a commit, no new rank to wait for
            sides[f"{name}_shrunk_ready"] = _shrunk(cell, nproc + 1, _width(size), survivors)
    return sides


def _shrunk(cell: str, nproc: int, width: int, survivors: bool) -> float:
    """``nproc`` -> ``nproc - 1`` at the commit after step 2: from that commit (whole in the
    agent, the ranks leave) to rank 0 ready again in the smaller group, rolled back."""
    out, commits = scratch(), []
    spec = JobSpec.create(nproc, min_nproc=nproc - 1, max_nproc=nproc, survivors=survivors)
    job = Job(spec, build_payload(cells.STAMP + cell, spec, namespace=cells.namespace(
        out, {"WIDTH": width, "KILL": 0, "STEPS": 6}))).start()

    def shrink() -> None:
        if job.wait_for_commit(2, timeout=600):
            job.scale(nproc - 1)

    def record(events: list[object]) -> None:
        commits.extend(e for e in events if isinstance(e, Committed) and e.world_size == nproc)

    threading.Thread(target=shrink, daemon=True).start()
    if not job.wait(record).ok or not commits:
        raise RuntimeError(f"the shrunk job failed or committed nothing at {nproc} ranks")
    return cells.every(out, f"ready0w{nproc - 1}", nproc - 1)[0] - commits[-1].time


# -- training efficiency under a failure every PERIOD seconds ------------------------------

# The training cell (a), committing every step, until rank 0's clock passes END_MS (every
# rank stops at the same step); rank 0 then writes its step counter to OUT/steps.
# OWN_CHECKPOINT (torchrun's side): a checkpoint of its own instead of the State's commits.
EFFICIENCY = cells.MLP_SETUP + textwrap.dedent("""
    import os, time
    state = elastic_magic.State(model=model, optimizer=optimizer, loader=loader, step=0)
    checkpoint = os.path.join(OUT, "checkpoint.pt")
    if OWN_CHECKPOINT and os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        state.step = saved["step"]
    stop = torch.zeros(1)
    while not stop.item():
        sampler.set_epoch(state.step // (SAMPLES // 48))
        for x, y in loader:
            train_step(x, y)
            state.step += 1
            if not OWN_CHECKPOINT:
                state.commit()
            elif dist.get_rank() == 0:
                torch.save({"model": model.module.state_dict(), "step": state.step,
                            "optimizer": optimizer.state_dict(), "loader": loader.state_dict()},
                           checkpoint + ".tmp")
                os.replace(checkpoint + ".tmp", checkpoint)
            stop[0] = time.time() * 1000 >= END_MS
            dist.broadcast(stop, 0)
            if stop.item():
                break
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "steps.tmp"), "w") as f:
            f.write(str(state.step))
        os.replace(os.path.join(OUT, "steps.tmp"), os.path.join(OUT, "steps"))
    del loader
    dist.destroy_process_group()
""")
# The same going on in place (@elastic_magic.run), as the docs show it.
EFFICIENCY_IN_PLACE = cells.MLP_OBJECTS + textwrap.dedent("""
    import os, time
    state = elastic_magic.State(model=net, optimizer=optimizer, loader=loader, step=0)

    @elastic_magic.run
    def train(state):
        model = DDP(net)
        stop = torch.zeros(1)
        while not stop.item():
            sampler.set_epoch(state.step // (SAMPLES // 48))
            for x, y in loader:
                step_of(model, x, y)
                state.step += 1
                state.commit()
                stop[0] = time.time() * 1000 >= END_MS
                dist.broadcast(stop, 0)
                if stop.item():
                    break

    train(state)
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "steps.tmp"), "w") as f:
            f.write(str(state.step))
        os.replace(os.path.join(OUT, "steps.tmp"), os.path.join(OUT, "steps"))
    del loader
    dist.destroy_process_group()
""")
SAMPLES = 48_000  # 1000 steps an epoch: few epoch starts (each forks the loader's workers)
RESTARTS = 1000  # more than the failures of any run


def _fail_every(period: float, end: float, workers: Callable[[], list[int]],
                seed: int) -> int:
    """SIGKILL one of ``workers()`` (PIDs) every ``period`` seconds from now until ``end``
    (``time.time()``): at each moment, one of those running then, or the first to run
    within the period after it. How many were killed."""
    rng, killed = random.Random(seed), 0
    moment = time.time() + period
    while moment < end - 1:
        time.sleep(max(0.0, moment - time.time()))
        while time.time() < moment + period:
            if alive := workers():
                with contextlib.suppress(ProcessLookupError):  # it ended: another at once
                    os.kill(rng.choice(alive), signal.SIGKILL)
                    killed += 1
                    break
            time.sleep(0.005)
        moment += period
    return killed


def _children(pid: int, name: str = "") -> list[int]:
    """The live children of ``pid`` (those whose command line holds ``name``)."""
    found = []
    try:
        for child in psutil.Process(pid).children():
            try:
                if child.status() != psutil.STATUS_ZOMBIE and name in " ".join(child.cmdline()):
                    found.append(child.pid)
            except psutil.NoSuchProcess:
                continue
    except psutil.NoSuchProcess:
        pass
    return found


def _steps(out: Path) -> int:
    steps = out / "steps"
    if not steps.exists():
        raise RuntimeError(f"the training did not write its step count in {out}")
    return int(steps.read_text())


def _values(end: float, own_checkpoint: bool) -> dict[str, int]:
    return {"SAMPLES": SAMPLES, "END_MS": int(end * 1000), "OWN_CHECKPOINT": int(own_checkpoint)}


def _ours(nproc: int, duration: float, period: float | None, survivors: bool,
          cell: str = EFFICIENCY) -> int:
    """Useful steps of the cell run as a job for ``duration`` s, failing every ``period``."""
    out, end = scratch(), time.time() + duration
    spec = JobSpec.create(nproc, max_restarts=RESTARTS, survivors=survivors)
    payload = build_payload(cell, spec,
                            namespace=cells.namespace(out, _values(end, False)))
    job = Job(spec, payload).start()
    killed: list[int] = []

    def workers() -> list[int]:  # each rank's worker: the child of its shepherd
        return [pid for shepherd in job.status_snapshot.pids.values()
                for pid in _children(shepherd)]

    killer = threading.Thread(target=lambda: period is None or killed.append(
        _fail_every(period, end, workers, 0)), daemon=True)
    killer.start()
    result = job.wait(lambda events: None)
    killer.join(timeout=60)
    if not result.ok or (period is not None and not (killed and killed[0])):
        raise RuntimeError(f"the job failed or nothing was killed: {result.summary()}")
    return _steps(out)


def _torchrun(nproc: int, duration: float, period: float | None) -> int:
    """The same under torchrun --max-restarts, saving its own checkpoint every step."""
    out, end = scratch(), time.time() + duration
    script = cells.script(EFFICIENCY, _values(end, True))
    killed: list[int] = []

    def fail(pid: int) -> None:
        if period is not None:
            killed.append(_fail_every(period, end, lambda: _children(pid, str(script)), 0))

    torchrun(script, nproc, str(out), timeout=duration + 120, while_running=fail,
             torchrun_args=(f"--max-restarts={RESTARTS}", "--monitor-interval=0.1"),
             env={**os.environ, **cells.ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    if period is not None and not killed[0]:
        raise RuntimeError("torchrun's workers were never killed")
    return _steps(out)


def survivors_efficiency(nproc: int, quick: bool) -> dict[str, float]:
    cells.set_env()
    # --quick keeps the period: at a failure every 5 s, torchrun's restarts (3-5 s here)
    # left it no step between failures
    duration, period = (30.0, 10.0) if quick else (300.0, 10.0)
    warm_up(cells.STAMP + cells.MLP, nproc,  # the pool has started and seen the cell
            namespace=cells.namespace(scratch(), cells.params(quick)))
    ours = _ours(nproc, duration, None, survivors=False)
    theirs = _torchrun(nproc, duration, None)
    return {"elastic_magic_in_place": _ours(nproc, duration, period, True,
                                            EFFICIENCY_IN_PLACE) / ours,
            "elastic_magic_survivors": _ours(nproc, duration, period, True) / ours,
            "elastic_magic_restart": _ours(nproc, duration, period, False) / ours,
            "torchrun": _torchrun(nproc, duration, period) / theirs}
