"""Memory and idle cost (MB, and CPU seconds): no competitor for most of it, torchrun's
worker for a rank's own memory.

- kernel_job_overhead: how much the launching process's RSS grows while a 2-rank job runs
  (agent thread, stores, pumps, buffers), after a first job;
- kernel_cpu_s: CPU seconds the launching process spends on a job whose ranks hold 3 s
  (what the agent, pumps and polling take from the workers' cores);
- pool_rss / pool_uss: the idle zygote (USS: the memory only it holds);
- pool_idle_cpu_s: CPU seconds the idle zygote used over 2 s (0 is the goal);
- worker_rss / worker_uss: a rank forked from the pool (its USS is what it does not share
  with the zygote), a fresh rank (``--no-pool``) and a torchrun rank, each after
  ``import torch`` and making the gloo group;
- the same after a training cell (training.py's (a): DDP, AdamW, ``elastic_magic.DataLoader``
  with 2 loader workers, a few steps), from the pool and under torchrun; the pool's zygote
  is measured after those cells ran (whatever they taught it to preload).
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
from pathlib import Path

import psutil

from elastic_magic.agent.node.pool import warm_pool

from . import cells
from .common import launch, scratch, settle_pool, stamps, torchrun, warm_up

MB = 1 << 20
RANK_MEMORY = textwrap.dedent("""
    import os, time, psutil, torch, torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()
    info = psutil.Process().memory_full_info()
    if dist.get_rank() == 0:
        for name, value in (("rss", info.rss), ("uss", info.uss)):
            with open(os.path.join(OUT, name), "w") as f:
                f.write(repr(value))
    time.sleep(HOLD)
""")
# After a training cell: rank 0's own memory, once it has trained (the loader's workers gone).
TRAINED_MEMORY = cells.STAMP + cells.MLP + textwrap.dedent("""
    import os, psutil
    if os.environ["RANK"] == "0":
        info = psutil.Process().memory_full_info()
        for name, value in (("rss", info.rss), ("uss", info.uss)):
            with open(os.path.join(OUT, name), "w") as f:
                f.write(repr(value))
""")


def _peak_rss_during(run: object) -> float:
    me, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()  # type: ignore[operator]
    finally:
        done.set()
        sampler.join()
    return peak[0]


def memory(nproc: int, quick: bool) -> dict[str, float]:
    pooled, fresh, theirs = scratch(), scratch(), scratch()

    def ours(out: Path, **options: object) -> None:
        launch(RANK_MEMORY, nproc, namespace={"OUT": str(out), "HOLD": 1.0},
               init_process_group=False, **options)

    # the pool is warm (and has psutil, which the cell imports), torch's once-only state made
    warm_up(RANK_MEMORY, nproc, namespace={"OUT": str(scratch()), "HOLD": 0.0},
            init_process_group=False)
    before = psutil.Process().memory_info().rss
    peak = _peak_rss_during(lambda: ours(pooled))
    me, hold = psutil.Process(), scratch()
    before_cpu = me.cpu_times()
    launch(RANK_MEMORY, nproc, namespace={"OUT": str(hold), "HOLD": 3.0},
           init_process_group=False)
    after_cpu = me.cpu_times()
    ours(fresh, pool=False)
    script = scratch() / "user_code.py"
    script.write_text("import sys\nOUT = sys.argv[1]\nHOLD = 0.0\n" + RANK_MEMORY)
    torchrun(script, nproc, str(theirs))
    cells.set_env()
    values = cells.params(quick)
    trained, trained_torchrun = scratch(), scratch()
    if not quick:  # a cell after the first (quick: the first)
        warm_up(TRAINED_MEMORY, nproc, namespace=cells.namespace(scratch(), values))
    launch(TRAINED_MEMORY, nproc, namespace=cells.namespace(trained, values))
    torchrun(cells.script(TRAINED_MEMORY, values), nproc, str(trained_torchrun),
             env={**os.environ, **cells.ENV})
    settle_pool()  # the zygote measured has what those cells taught it
    (zygote,) = [psutil.Process(pid) for pid in warm_pool().pids]
    idle = zygote.cpu_times()
    time.sleep(2.0)
    busy = zygote.cpu_times()
    pool = zygote.memory_full_info()
    return {
        "kernel_job_overhead_mb": (peak - before) / MB,
        "kernel_cpu_s": (after_cpu.user + after_cpu.system)
        - (before_cpu.user + before_cpu.system),
        "pool_rss_mb": pool.rss / MB, "pool_uss_mb": pool.uss / MB,
        "pool_idle_cpu_s": (busy.user + busy.system) - (idle.user + idle.system),
        "worker_rss_mb (pool)": stamps(pooled, "rss")[0] / MB,
        "worker_uss_mb (pool)": stamps(pooled, "uss")[0] / MB,
        "worker_rss_mb (--no-pool)": stamps(fresh, "rss")[0] / MB,
        "worker_uss_mb (--no-pool)": stamps(fresh, "uss")[0] / MB,
        "worker_rss_mb (torchrun)": stamps(theirs, "rss")[0] / MB,
        "worker_uss_mb (torchrun)": stamps(theirs, "uss")[0] / MB,
        "trained_worker_rss_mb (pool)": stamps(trained, "rss")[0] / MB,
        "trained_worker_uss_mb (pool)": stamps(trained, "uss")[0] / MB,
        "trained_worker_rss_mb (torchrun)": stamps(trained_torchrun, "rss")[0] / MB,
        "trained_worker_uss_mb (torchrun)": stamps(trained_torchrun, "uss")[0] / MB,
    }
