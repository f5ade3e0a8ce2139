"""Sessions beside ipyparallel: a trivial cell, a cell with one gloo all_reduce, the start,
and re-forming after a crash (which ipyparallel does not do).

- elastic_magic session: ``Session.run`` on a live session (the kernel waits for every
  rank's value and output, as a %%elastic cell does);
- one_shot_job: elastic_magic's one-shot ``launch()`` of the same cell, warm pool (for scale);
- ipyparallel: ``view.execute(code, block=True)`` on a local cluster of as many engines, what
  ``%px`` runs; the all_reduce goes over a gloo process group the engines made once.

ipyparallel is the ``bench`` extra (``pip install elastic-magic[bench]``).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import elastic_magic

from .common import free_port, launch, warm_up

TRIVIAL = "x = 1"
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)"


def _quiet(events: list[Any]) -> None:
    pass


@contextmanager
def _session(nproc: int) -> Iterator[elastic_magic.Session]:
    session = elastic_magic.Session(nproc=nproc, render=_quiet)
    try:
        yield session
    finally:
        session.stop()


@contextmanager
def cluster(nproc: int) -> Iterator[Any]:
    import ipyparallel as ipp

    cluster = ipp.Cluster(n=nproc, log_level=40)
    client = cluster.start_and_connect_sync()
    try:
        client.wait_for_engines(nproc, timeout=120)
        yield client
    finally:
        client.close()
        cluster.stop_cluster_sync()


def _median_ms(run: Any, cells: int) -> float:
    run()  # the first one is not timed
    times = []
    for _ in range(cells):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def session_cell(nproc: int, quick: bool) -> dict[str, float]:
    """Median latency of a trivial cell (ms)."""
    cells = 20 if quick else 200
    with _session(nproc) as session:
        ours = _median_ms(lambda: session.run(TRIVIAL), cells)
    with cluster(nproc) as client:
        view = client[:]
        theirs = _median_ms(lambda: view.execute(TRIVIAL, block=True), cells)
    warm_up(TRIVIAL, nproc)
    job = _median_ms(lambda: launch(TRIVIAL, nproc), 3 if quick else 10)
    return {"elastic_magic_session": ours, "ipyparallel_px": theirs,
            "one_shot_job": job}


def session_allreduce(nproc: int, quick: bool) -> dict[str, float]:
    """Median latency of a cell that does one gloo all_reduce (ms), the group made once."""
    cells = 20 if quick else 200
    with _session(nproc) as session:
        session.run("import torch, torch.distributed as dist\ndist.barrier()")
        ours = _median_ms(lambda: session.run(ALL_REDUCE), cells)
    with cluster(nproc) as client:
        view = client[:]
        view.scatter("rank", list(range(nproc)), flatten=True, block=True)
        view.execute("import torch, torch.distributed as dist\n"
                     f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:"
                     f"{free_port()}', rank=rank, world_size={nproc})", block=True)
        theirs = _median_ms(lambda: view.execute(ALL_REDUCE, block=True), cells)
        view.execute("dist.destroy_process_group()", block=True)
    return {"elastic_magic_session": ours, "ipyparallel_px": theirs}


def session_start(nproc: int, quick: bool) -> dict[str, float]:
    """From nothing to the first trivial cell's result (s)."""
    started = time.perf_counter()
    with _session(nproc) as session:
        session.run(TRIVIAL)
        ours = time.perf_counter() - started
    started = time.perf_counter()
    with cluster(nproc) as client:
        client[:].execute(TRIVIAL, block=True)
        theirs = time.perf_counter() - started
    return {"elastic_magic_session": ours, "ipyparallel_cluster": theirs}


def session_reform(nproc: int, quick: bool) -> dict[str, float]:
    """A rank is SIGKILLed between cells; the next trivial cell re-forms the session
    (round, workers, one setup cell replayed) and runs (s). The setup cell's own run time
    and the trivial cell's are measured apart, to be subtracted against the 0.5 s goal."""
    with _session(nproc) as session:
        session.run("import os\npid = os.getpid()", setup=True)
        started = time.perf_counter()
        session.run("import os\npid = os.getpid()")
        setup_cell = time.perf_counter() - started
        trivial = _median_ms(lambda: session.run(TRIVIAL), 5) / 1000
        os.kill(session.pull("pid", rank=nproc - 1), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while session.status()["restarts"].startswith("0/") and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.perf_counter()
        session.run(TRIVIAL)
        reform = time.perf_counter() - started
    return {"elastic_magic_session": reform - setup_cell - trivial,
            "elastic_magic_session_total": reform}
