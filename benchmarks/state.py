"""The elastic State at scale, beside torch.distributed.checkpoint (DCP), on 2 ranks.

The model: ``LAYERS`` square Linear layers with Adam; its training state (parameters and
both moments) is about 2 GB (10 layers of 4096: 168M float32 parameters), 200 MB with
``--quick`` (4 layers of 2048). Each figure is measured inside the workers and is the
slowest rank's, for a DDP model (replicated) and an FSDP2 one (``fully_shard`` on each
layer, then the model: ``_fsdp`` sides):

- state_commit: the time ``state.commit()`` blocks training, beside ``dcp.save`` and the
  part of ``dcp.async_save`` that blocks (it returns once the state is staged in memory),
  each from ``get_state_dict`` as DCP's users call it. Every save starts with the one
  before it done (``async_save``'s future waited, our commit drained), so each side shows
  what it costs a training that commits less often than a save takes; the first of each is
  left out (memory the allocators take once);
- state_restore: a restart at 2 ranks restoring the commit made at 2 (``State(...)`` to its
  return), and a resize 2 -> 3 restoring it resharded, beside ``dcp.load`` (+
  ``set_state_dict``) of DCP's checkpoint of the same state into a freshly built model at
  2 and at 3 ranks (DCP's files in the page cache: written just before);
- state_overhead: training steps/s with a commit every 10 steps beside none, in one job:
  blocks of 10 steps alternated, each block with a commit timed to the end of that
  commit's sending (so all of it counts, hidden behind the steps or not);
- state_kernel_rss: the peak RSS of the process that launched the job (the kernel),
  sampled every 20 ms, over 10 steps with a State committing every 5 and over the same
  steps without a State; its anonymous part (``_anon``: the heap), and the memory files it
  holds open (``_memfd``: the agent's snapshots, shared memory that no RSS counts while
  unmapped).
"""

from __future__ import annotations

import os
import re
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from elastic_magic.agent.handles.job import Job
from elastic_magic.spec import JobSpec
from elastic_magic.wire.events import Output
from elastic_magic.wire.payload import build_payload

from .common import launch, scratch

MB = 1 << 20
MODES = {"": False, "_fsdp": True}  # side suffix -> an FSDP2 model

MODEL = textwrap.dedent("""
    import os, signal, time, torch, torch.distributed as dist, elastic_magic
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from elastic_magic.worker.client import current

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    if SHARDED:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    rank, world = dist.get_rank(), dist.get_world_size()

    def train_step():
        model(torch.randn(BATCH, WIDTH)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def slowest(seconds):
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(call):
        dist.barrier()
        started = time.perf_counter()
        out = call()
        return out, slowest(time.perf_counter() - started)

    def dcp_state():
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def drained():
        client = current()
        if client is not None:
            client.drain()
        dist.barrier()
""")

COMMIT = MODEL + textwrap.dedent("""
    train_step()  # Adam's moments exist
    # async_save's thread runs collectives: on a group of its own, or they mix with ours
    save_group = dist.new_group(backend="gloo")
    state = elastic_magic.State(model=model, optimizer=opt, step=0)
    times = {"ours": [], "save": [], "async": []}
    for i in range(REPEAT + 1):
        state.step += 1
        _, took = timed(state.commit)
        times["ours"].append(took)
        drained()
        _, took = timed(lambda: dcp.save(dcp_state(), checkpoint_id=f"{DIR}/save{i % 2}"))
        times["save"].append(took)
        future, took = timed(lambda: dcp.async_save(dcp_state(),
                                                   checkpoint_id=f"{DIR}/async{i % 2}",
                                                   process_group=save_group))
        times["async"].append(took)
        future.result()
        dist.barrier()
    {side: values[1:] for side, values in times.items()}
""")

# First run: commit step 1 and DCP's save of it, then rank 1 dies. The restart (2 ranks)
# restores and commits until the driver resizes it to 3, which restores again.
RESTORE = MODEL + textwrap.dedent("""
    state, took = timed(lambda: elastic_magic.State(model=model, optimizer=opt, step=0))
    if state.restored_step is None:
        train_step()
        state.step = 1
        state.commit()
        dcp.save(dcp_state(), checkpoint_id=DIR)
        drained()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    if rank == 0:
        print(f"RESTORED {world} {took}", flush=True)
    while world == 2:  # until the resize, at a commit
        time.sleep(0.1)
        state.commit()
""")

DCP_LOAD = MODEL + textwrap.dedent("""
    def load():
        sd = dcp_state()
        dcp.load(sd, checkpoint_id=DIR)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    _, took = timed(load)
    took
""")

# Blocks of EVERY steps, without and with a commit at the block's end, alternated (the
# machine's drift falls on both); a block with a commit ends once its sending is done, so
# the whole commit counts in it. The first block (and commit) is a warm-up.
OVERHEAD = MODEL + textwrap.dedent("""
    state = elastic_magic.State(model=model, optimizer=opt, step=0)
    took = {False: 0.0, True: 0.0}
    for block in range(1 + 2 * BLOCKS):
        committing = block % 2 == 0
        dist.barrier()
        started = time.perf_counter()
        for _ in range(EVERY):
            train_step()
            if committing:
                state.step += 1
                state.commit(every=EVERY)
        if committing:
            drained()
        if block:
            took[committing] += slowest(time.perf_counter() - started)
    {"with": BLOCKS * EVERY / took[True], "without": BLOCKS * EVERY / took[False]}
""")

# The same training, with a State committing every EVERY steps or without one.
TRAIN = MODEL + textwrap.dedent("""
    state = elastic_magic.State(model=model, optimizer=opt, step=0) if WITH_STATE else None
    for _ in range(STEPS):
        train_step()
        if state is not None:
            state.step += 1
            state.commit(every=EVERY)
    drained()
""")


def _sizes(quick: bool, sharded: bool) -> dict[str, Any]:
    width, layers = (2048, 4) if quick else (4096, 10)
    return {"WIDTH": width, "LAYERS": layers, "BATCH": 8, "SHARDED": sharded}


def state_commit(nproc: int, quick: bool) -> dict[str, float]:
    import statistics

    out: dict[str, float] = {}
    for suffix, sharded in MODES.items():
        folder = scratch("em-bench-dcp-")
        result = launch(COMMIT, nproc, namespace={**_sizes(quick, sharded), "DIR": str(folder),
                                                  "REPEAT": 2 if quick else 3})
        if not result.ok:
            raise RuntimeError(f"the commit cell failed: {result}")
        times = result.values[0]
        for side, name in (("elastic_magic", "ours"), ("dcp_save", "save"),
                           ("dcp_async_save", "async")):
            out[side + suffix] = statistics.median(times[name])
        _remove(folder)
    return out


def state_restore(nproc: int, quick: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    bigger = nproc + 1
    for suffix, sharded in MODES.items():
        folder = scratch("em-bench-dcp-")
        values = {**_sizes(quick, sharded), "DIR": str(folder)}
        restored = _restore_run(nproc, bigger, values)
        out[f"elastic_magic{suffix}"] = restored[nproc]
        out[f"elastic_magic_reshard{suffix}"] = restored[bigger]
        for size, side in ((nproc, "dcp_load"), (bigger, "dcp_load_reshard")):
            result = launch(DCP_LOAD, size, namespace=values)
            if not result.ok:
                raise RuntimeError(f"dcp.load at {size} ranks failed: {result}")
            out[side + suffix] = result.values[0]
        _remove(folder)
    return out


def _restore_run(nproc: int, bigger: int, values: dict[str, Any]) -> dict[int, float]:
    """{world size: seconds} of the restores at ``nproc`` (a restart) and at ``bigger``."""
    spec = JobSpec.create(nproc, min_nproc=1, max_nproc=bigger, max_restarts=1)
    job = Job(spec, build_payload(RESTORE, spec, namespace=values)).start()
    restored: dict[int, float] = {}
    pattern = re.compile(r"RESTORED (\d+) (\S+)")

    def seen(events: list[Any]) -> None:
        for event in events:
            for line in event.lines if isinstance(event, Output) else ():
                match = pattern.match(line)
                if match:
                    restored[int(match[1])] = float(match[2])

    def drive() -> None:
        deadline = time.monotonic() + 600
        while nproc not in restored and not job.done and time.monotonic() < deadline:
            time.sleep(0.05)
        if nproc in restored:
            job.scale(bigger)

    threading.Thread(target=drive, daemon=True).start()
    result = job.wait(seen)
    if set(restored) != {nproc, bigger}:
        raise RuntimeError(f"restores seen at {sorted(restored)}, not at {nproc} and "
                           f"{bigger}: {result}")
    return restored


def state_overhead(nproc: int, quick: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for suffix, sharded in MODES.items():
        values = {**_sizes(quick, sharded), "EVERY": 10, "BLOCKS": 2}
        result = launch(OVERHEAD, nproc, namespace=values)
        if not result.ok:
            raise RuntimeError(f"the training cell failed: {result}")
        out[f"elastic_magic{suffix}"] = result.values[0]["with"]
        out[f"without_state{suffix}"] = result.values[0]["without"]
    return out


def state_kernel_rss(nproc: int, quick: bool) -> dict[str, float]:
    """Peaks over each training: RSS, its anonymous part, and the memory files this
    process holds (snapshots the agent keeps: shared memory, in no RSS while unmapped)."""
    out: dict[str, float] = {}
    for suffix, sharded in MODES.items():
        for with_state, side in ((False, "without_state"), (True, "elastic_magic")):
            values = {**_sizes(quick, sharded), "WITH_STATE": with_state, "EVERY": 5,
                      "STEPS": 10}
            with _Peak() as peak:
                result = launch(TRAIN, nproc, namespace=values)
            if not result.ok:
                raise RuntimeError(f"the training cell failed: {result}")
            out[f"{side}{suffix}"] = peak.rss / MB
            out[f"{side}_anon{suffix}"] = peak.anon / MB
            out[f"{side}_memfd{suffix}"] = peak.memfd / MB
            del result  # its snapshot, if any, goes before the next run
    return out


class _Peak:
    """This process's peak RSS and peak anonymous RSS while the block runs."""

    def __init__(self) -> None:
        self.rss = self.anon = self.memfd = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._done.is_set():
            self.rss = max(self.rss, me.memory_info().rss)
            self.anon = max(self.anon, _rss_anon())
            self.memfd = max(self.memfd, _memfd_bytes())
            time.sleep(0.02)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _memfd_bytes() -> int:
    """The size of the anonymous memory files this process has open, each file once
    (several descriptors may be open on one)."""
    sizes: dict[int, int] = {}
    for fd in Path("/proc/self/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:"):
                info = os.stat(fd)
                sizes[info.st_ino] = info.st_size
        except OSError:  # closed meanwhile
            continue
    return sum(sizes.values())


def _remove(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
