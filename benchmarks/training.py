"""Cells that train, beside the same script under torchrun and accelerate's notebook_launcher.

Each figure runs from the moment the user starts the cell (``launch``, as Shift+Enter does;
the torchrun command; the ``notebook_launcher`` call) to the first ``optimizer.step()``
done on every rank (the latest rank's ``time.time()`` written right after it; cells.py):

- train_mlp: (a) a DDP MLP with AdamW fed by ``elastic_magic.DataLoader`` (2 loader
  workers); elastic_magic warm (the same cell ran once before: a cell after the first),
  ``torchrun --standalone``, and ``notebook_launcher`` from a fresh process standing in for
  a kernel that imported torch but never built DDP;
- train_lightning: (b) ``Trainer.fit`` with ``strategy="ddp"``; train_hf: (c) a HuggingFace
  ``Trainer`` on a 1-layer GPT-2 built from a config (offline);
- train_recovery: (a) with rank 1 SIGKILLed after its first step, from the kill to the
  restart's first step on every rank, beside ``torchrun --max-restarts 1
  --monitor-interval 0.1`` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as ``recovery``);
- train_resize: (a) with a State committing every step, ``job.scale(3)``: from the request
  to the first step at world size 3 on every rank;
- train_recovery_survivors, train_resize_survivors (issue 21): the same with a State
  committing every step, the survivors staying in their processes (``--survivors``) beside
  every rank starting again (``restart``), and torchrun's recovery as in train_recovery;
  ``in_place_steady``: killed at step STEADY instead of the first, as a failure comes in a
  training that has run a while (the pool's spares refilled, the loaders' workers up);
- session_train: (a) in a ``Session``: the setup (model, optimizer, loader) once, then
  training cells; per cell to the first step on every rank, and the whole cell; beside
  ipyparallel's ``%px`` (``view.execute``) running the same cells on as many engines;
  session_train_reform: a rank SIGKILLed between cells, the next training cell (re-formed:
  setup replayed) to its first step on every rank.

Both sides run with OMP_NUM_THREADS=1, gloo, 2 ranks (``--nproc``), HF offline.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import elastic_magic
from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.payload import build_payload

from . import cells
from .common import free_port, launch, now, scratch, settle_pool, stamps, warm_up
from .session import cluster


def _ours(code: str, nproc: int, values: dict[str, int], **options: Any) -> float:
    out = scratch()
    started = now()
    launch(cells.STAMP + code, nproc, namespace=cells.namespace(out, values), **options)
    return cells.first_step(out, started, nproc)


def _warm_up(code: str, nproc: int, values: dict[str, int]) -> None:
    """The cell once, untimed: the pool has seen it (and built what it taught it)."""
    warm_up(cells.STAMP + code, nproc, namespace=cells.namespace(scratch(), values))


def _beside_torchrun(code: str, nproc: int, quick: bool,
                     launcher: bool = False) -> dict[str, float]:
    """Ours warm, beside torchrun (and with ``launcher``, notebook_launcher)."""
    cells.set_env()
    values = cells.params(quick)
    _warm_up(code, nproc, values)
    out, started = cells.run_torchrun(code, nproc, values)
    theirs = {"torchrun": cells.first_step(out, started, nproc)}
    if launcher:
        theirs["notebook_launcher"] = cells.notebook_launcher(code, nproc, values)
    return {"elastic_magic": _ours(code, nproc, values), **theirs}


def train_mlp(nproc: int, quick: bool) -> dict[str, float]:
    return _beside_torchrun(cells.MLP, nproc, quick, launcher=True)


def train_lightning(nproc: int, quick: bool) -> dict[str, float]:
    return _beside_torchrun(cells.LIGHTNING, nproc, quick)


def train_hf(nproc: int, quick: bool) -> dict[str, float]:
    return _beside_torchrun(cells.HF, nproc, quick)


def _recovered(out: Any, nproc: int) -> float:
    """From the kill to the restart's first step on every rank."""
    return max(cells.every(out, "step1", nproc)) - cells.every(out, "kill", 1)[0]


def train_recovery(nproc: int, quick: bool) -> dict[str, float]:
    cells.set_env()
    values = cells.params(quick)
    _warm_up(cells.MLP, nproc, values)
    ours = scratch()
    launch(cells.STAMP + cells.MLP_KILLED, nproc, namespace=cells.namespace(ours, values),
           max_restarts=1)
    theirs, _ = cells.run_torchrun(cells.MLP_KILLED, nproc, values, "--max-restarts=1",
                                   "--monitor-interval=0.1",
                                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return {"elastic_magic": _recovered(ours, nproc), "torchrun": _recovered(theirs, nproc)}


STEADY = 40  # steps before the kill: about half a second of training here


def train_recovery_survivors(nproc: int, quick: bool) -> dict[str, float]:
    cells.set_env()
    values = cells.params(quick)
    _warm_up(cells.MLP, nproc, values)
    sides = {}
    for side, survivors, cell, kill_at in (
            ("elastic_magic_in_place", True, cells.MLP_IN_PLACE, 1),
            ("elastic_magic_in_place_steady", True, cells.MLP_IN_PLACE, STEADY),
            ("elastic_magic_survivors", True, cells.MLP_KILLED_STATE, 1),
            ("elastic_magic_restart", False, cells.MLP_KILLED_STATE, 1)):
        out = scratch()
        steps = {"STEPS": max(values["STEPS"], kill_at + 2)}
        launch(cells.STAMP + cell, nproc, max_restarts=1, survivors=survivors,
               namespace=cells.namespace(out, {**values, **steps, "KILL": 1, "KILL_AT": kill_at,
                                               "RESIZE": 0}))
        sides[side] = _recovered(out, nproc)
    theirs, _ = cells.run_torchrun(cells.MLP_KILLED, nproc, values, "--max-restarts=1",
                                   "--monitor-interval=0.1",
                                   env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    return {**sides, "torchrun": _recovered(theirs, nproc)}


def train_resize_survivors(nproc: int, quick: bool) -> dict[str, float]:
    return {"elastic_magic_in_place": _resize(nproc, quick, survivors=True,
                                              cell=cells.MLP_IN_PLACE),
            "elastic_magic_survivors": _resize(nproc, quick, survivors=True),
            "elastic_magic_restart": _resize(nproc, quick, survivors=False)}


def train_resize(nproc: int, quick: bool) -> dict[str, float]:
    return {"elastic_magic": _resize(nproc, quick, survivors=False)}


def _resize(nproc: int, quick: bool, survivors: bool, cell: str = cells.MLP_ELASTIC) -> float:
    """2 -> 3 (``nproc`` -> ``nproc + 1``) at the next commit."""
    cells.set_env()
    values = {**cells.params(quick, SAMPLES=960), "STEPS": 100000, "KILL": 0, "RESIZE": 1}
    _warm_up(cells.MLP, nproc, values)
    out, bigger = scratch(), nproc + 1
    spec = JobSpec.create(nproc, min_nproc=1, max_nproc=bigger, survivors=survivors)
    job = Job(spec, build_payload(cells.STAMP + cell, spec,
                                  namespace=cells.namespace(out, values))).start()
    requested: list[float] = []

    def drive() -> None:
        try:
            job.wait_for_commit(3, timeout=120)
            requested.append(time.time())
            job.scale(bigger)
            deadline = time.monotonic() + 60
            while len(stamps(out, f"w{bigger}_")) < bigger and not job.done \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            job.stop("benchmark done")

    threading.Thread(target=drive, daemon=True).start()
    job.wait(lambda events: None)
    done = stamps(out, f"w{bigger}_")
    if not requested or len(done) < bigger:
        raise RuntimeError(f"the group did not reach {bigger} ranks (stamps: {len(done)})")
    return max(done) - requested[0]


# -- sessions ---------------------------------------------------------------------------

SESSION_TRAIN = "cell += 1\nsampler.set_epoch(cell)\n" \
    + cells.MLP_TRAIN.replace('stamp("step")', 'stamp(f"c{cell}")')


def _session(nproc: int, quick: bool) -> tuple[elastic_magic.Session, Any]:
    cells.set_env()
    out = scratch()
    session = elastic_magic.Session(nproc=nproc, render=lambda events: None)
    session.push(setup=True, **cells.namespace(out, cells.params(quick, SAMPLES=2400)))
    session.run(cells.STAMP + cells.MLP_SETUP + "import os\ncell = 0\n"
                "pid = os.getpid()\n", setup=True)
    return session, out


def _train_cell(run: Callable[[str], object], out: Any, cell: int,
                nproc: int) -> tuple[float, float]:
    """(to the first step on every rank, the whole cell) of the ``cell``-th training cell."""
    started = now()
    run(SESSION_TRAIN)
    total = now() - started
    return cells.first_step(out, started, nproc, f"c{cell}"), total


def _medians(runs: list[tuple[float, float]], side: str) -> dict[str, float]:
    timed = runs[1:]  # the first training cell is not timed
    return {side: statistics.median(first for first, _ in timed),
            f"{side}_cell": statistics.median(total for _, total in timed)}


def _px_train(nproc: int, quick: bool, count: int) -> list[tuple[float, float]]:
    """The same cells through ipyparallel's ``%px`` (``view.execute``) on as many engines,
    their gloo group made by the setup cell from the variables torchrun would set."""
    out = scratch()
    with cluster(nproc) as client:
        view = client[:]
        view.scatter("RANK", [str(rank) for rank in range(nproc)], flatten=True, block=True)
        view.execute(f"import os\nos.environ.update(RANK=RANK, WORLD_SIZE='{nproc}', "
                     f"MASTER_ADDR='127.0.0.1', MASTER_PORT='{free_port()}')", block=True)
        view.push(cells.namespace(out, cells.params(quick, SAMPLES=2400)), block=True)
        view.execute(cells.STAMP + cells.MLP_SETUP + "cell = 0\n", block=True)

        def run(code: str) -> object:
            return view.execute(code, block=True)

        runs = [_train_cell(run, out, cell, nproc) for cell in range(1, count + 1)]
        view.execute("del loader\ndist.destroy_process_group()", block=True)
    return runs


def session_train(nproc: int, quick: bool) -> dict[str, float]:
    count = 3 if quick else 10
    session, out = _session(nproc, quick)
    try:
        ours = [_train_cell(session.run, out, 1, nproc)]
        settle_pool()  # the later cells are timed: what the first taught the pool is built
        ours += [_train_cell(session.run, out, cell, nproc) for cell in range(2, count + 1)]
    finally:
        session.stop()
    return {**_medians(ours, "elastic_magic_session"),
            **_medians(_px_train(nproc, quick, count), "ipyparallel_px")}


def session_train_reform(nproc: int, quick: bool) -> dict[str, float]:
    session, out = _session(nproc, quick)
    try:
        _train_cell(session.run, out, 1, nproc)
        settle_pool()  # the re-formed rank forks from the zygote the cell taught
        os.kill(session.pull("pid", rank=nproc - 1), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while session.status()["restarts"].startswith("0/") and time.monotonic() < deadline:
            time.sleep(0.01)
        for path in out.glob("c1_*"):  # the re-formed ranks count their cells from 0 again
            path.unlink()
        reform, total = _train_cell(session.run, out, 1, nproc)
    finally:
        session.stop()
    return {"elastic_magic_session": reform, "elastic_magic_session_cell": total}
