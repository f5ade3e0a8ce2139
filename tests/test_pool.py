"""The warm pool: workers forked from a zygote that imported torch, with everything a fresh
worker has; rebuilt when what workers inherit changes; gone with its owner."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
from conftest import SHEPHERD, TAG, ZYGOTE, descriptors, is_spare, job_processes

import elastic_magic as em
from elastic_magic.agent.node.pool import shutdown_pool, warm_pool

# What a rank sees of itself, and whose child its shepherd is (the zygote, or us). The
# first attempt's rank 1 fails, so the restarted group's workers are seen too.
PROBE = textwrap.dedent("""
    import atexit, os, random, signal, sys
    import numpy, torch
    atexit.register(print, "the cell's atexit ran", flush=True)
    left_open = open(os.path.join(FILES, os.environ["RANK"]), "w")
    left_open.write("written, never closed")
    import json, torch.distributed as dist
    dist.barrier()
    shepherd = os.getppid()
    with open(f"/proc/{shepherd}/stat") as stat:
        spawner = int(stat.read().rpartition(")")[2].split()[1])
    with open(f"/proc/{spawner}/comm") as comm:
        spawner_name = comm.read().strip()
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    seen = dict(env=dict(os.environ), cwd=os.getcwd(), path=sys.path, argv=sys.argv,
                main=__name__, name=name, spawner=spawner_name,
                sid=os.getsid(0) == os.getpid(), fds=len(os.listdir("/proc/self/fd")),
                random=random.random(), numpy=float(numpy.random.random()),
                torch_seed=torch.initial_seed(), cuda=torch.cuda.is_initialized(),
                blocked=sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                shepherd=shepherd)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(FILES, f"seen_{attempt}_{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    if attempt == "0" and dist.get_rank() == 1:
        sys.exit(3)
    seen
""")
PER_JOB = {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_PORT"}


def _probe(log_dir, files, **options):
    # gloo: the pool's behaviour, also on a machine with one GPU (where nccl allows 1 rank)
    result = em.launch(PROBE, nproc=2, backend="gloo", namespace={"FILES": str(files)},
                       max_restarts=1, argv="--lr 0.1", log_dir=log_dir,
                       render=lambda e: None, **options)
    assert result.restarts == 1
    for rank in (0, 1):  # the interpreter ended as interpreters end
        assert "the cell's atexit ran" in result.tails[rank]
        assert (files / str(rank)).read_text() == "written, never closed"
    return result.values


def _zygotes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == ZYGOTE and proc.environ().get(
                    "ELASTIC_MAGIC_TEST_TAG") == TAG:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _spares() -> list[psutil.Process]:
    """The spare ranks' shepherds of this test run's zygotes (``worker/spares.py``)."""
    return [proc for zygote in _zygotes() for proc in zygote.children() if is_spare(proc)]


def _tagged_spares() -> list[psutil.Process]:
    """Every spare's shepherd of this test run, whoever its parent is now."""
    found = []
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            if proc.info["name"] == SHEPHERD and is_spare(proc) and proc.environ().get(
                    "ELASTIC_MAGIC_TEST_TAG") == TAG:
                found.append(proc)
    return found


def _wait_for_spares(count: int) -> set[int]:
    deadline = time.monotonic() + 30
    while len(spares := _spares()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(spares) == count
    return {proc.pid for proc in spares}


def test_a_pooled_worker_is_a_fresh_worker_but_forked(log_dir, tmp_path):
    """Workers from the pool, spares forked ahead and restarted ones, see what fresh
    interpreters see: environment, cwd, sys.path, argv, __main__, their own session, no
    stray descriptors, their own random state (Python's, numpy's, torch's), no CUDA; at
    the end, atexit runs and files left open are flushed. The zygote keeps a spare for
    each rank of the last job; one that dies idle is reaped and replaced; none outlives the
    pool."""
    em.launch("1", nproc=2, log_dir=log_dir, render=lambda e: None)
    spares = _wait_for_spares(2)
    gone = spares.pop()
    psutil.Process(gone).children()[0].kill()  # its shepherd then ends
    deadline = time.monotonic() + 10
    while psutil.pid_exists(gone) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(gone)  # the zygote saw it die and reaped it
    (kept,) = spares
    # Relayed to the idle worker, which has it blocked: it must not end the job it takes.
    os.kill(kept, signal.SIGTERM)
    pooled = _probe(log_dir, tmp_path)
    first = {rank: json.loads((tmp_path / f"seen_0_{rank}.json").read_text())
             for rank in (0, 1)}
    assert kept in {seen["shepherd"] for seen in first.values()}  # it took a job
    fresh = _probe(log_dir, tmp_path, pool=False)
    assert ZYGOTE not in {v["spawner"] for v in fresh.values()}
    for attempt, seen in ((0, first), (1, pooled)):
        assert {v["spawner"] for v in seen.values()} == {ZYGOTE}
        for rank in (0, 1):
            ours, theirs = seen[rank], fresh[rank]
            for env in (ours["env"], theirs["env"]):
                for name in PER_JOB:
                    env.pop(name, None)
            theirs["env"]["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
            assert ours["env"] == theirs["env"]
            assert ours["env"]["RANK"] == str(rank)
            for key in ("cwd", "path", "argv", "main", "name", "sid", "fds", "cuda",
                        "blocked"):
                assert ours[key] == theirs[key], key
            assert ours["argv"][1:] == ["--lr", "0.1"] and ours["main"] == "__main__"
        # Forked from one process, each rank still draws its own random numbers.
        assert seen[0]["random"] != seen[1]["random"]
        assert seen[0]["numpy"] != seen[1]["numpy"]
        assert seen[0]["torch_seed"] != seen[1]["torch_seed"]
    refilled = _wait_for_spares(2)
    assert not refilled & {seen["shepherd"] for seen in [*first.values(), *pooled.values()]}
    shutdown_pool()
    assert not any(psutil.pid_exists(pid) for pid in refilled)  # ended and reaped at once


def test_the_pool_is_kept_while_workers_would_inherit_the_same_and_rebuilt_otherwise(
        log_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def zygote_after(**options) -> tuple[int, float]:
        """The zygote after a cell: its PID and start time (a PID freed may be reused at
        once on some machines: the pair names one process)."""
        em.launch("1", nproc=1, log_dir=log_dir, render=lambda e: None, **options)
        (pid,) = warm_pool().pids
        return pid, psutil.Process(pid).create_time()

    def pool_state() -> str:
        pool = warm_pool()
        return (f"{pool.describe()}, failed fingerprints {len(pool._failed)}, retired "
                f"{[z.pid for z in pool._retired]}, sys.path {sys.path[:3]}")

    first = zygote_after()
    (tmp_path / "results.txt").write_text("a cell's file in cwd")
    assert zygote_after() == first
    last = zygote_after(env=["POOL_TEST=1"])  # --env: what workers inherit changed
    assert last != first and not _alive(*first)  # the old one has ended
    monkeypatch.setenv("POOL_TEST_KERNEL", "1")  # so did the kernel's environment
    assert last != (last := zygote_after(env=["POOL_TEST=1"]))
    packages = tmp_path / "site-packages"
    packages.mkdir()
    monkeypatch.syspath_prepend(str(packages))  # sys.path
    # The message says why, where this has failed (once, on a GPU machine only).
    assert last != (last := zygote_after(env=["POOL_TEST=1"])), pool_state()
    (packages / "new_package").mkdir()  # a package was installed
    assert last != zygote_after(env=["POOL_TEST=1"])
    assert {spare.ppid() for spare in _tagged_spares()} <= set(warm_pool().pids)
    shutdown_pool()
    assert not _zygotes() and not _tagged_spares()  # retired ones' spares ended too


def test_every_worker_of_a_job_shares_one_zygote(tmp_path):
    """What differs between one job's workers (rank, slot, GPUs, the machine's interface)
    is set after the fork: it must not make each worker a zygote of its own."""
    from elastic_magic.agent.node.environment import torchrun_env
    from elastic_magic.agent.node.pool import fingerprint
    from elastic_magic.agent.node.workers import Worker
    from elastic_magic.agent.round_info import RoundInfo
    from elastic_magic.wire.events import NetworkChosen

    spec = em.JobSpec.create(3, gpus=4, backend="gloo", log_dir=tmp_path)
    network = NetworkChosen("10.0.0.2", "eth0", (("GLOO_SOCKET_IFNAME", "eth0"),), (),
                            "host", "10.0.0.2")
    keys = set()
    for round_, slots in ((RoundInfo(1, "a", 0, 1, 0, 3, "10.0.0.1", 29500), [0, 1, 2]),
                          (RoundInfo(2, "b", 1, 2, 3, 6, "10.0.0.1", 29501), [0, 2, 3])):
        for i in range(3):
            env = torchrun_env(Worker(local_rank=i, global_rank=round_.base_rank + i,
                                      attempt=round_.round), round_, spec, nproc=3,
                               run_id="em-x", restart_count=round_.round,
                               error_file=tmp_path / f"{i}.json", network=network, slots=slots)
            keys.add(fingerprint(env, str(tmp_path), sys.path))
    assert len(keys) == 1


OWNER = textwrap.dedent("""
    import sys, time
    import elastic_magic as em
    from elastic_magic.agent.node.pool import warm_pool
    from elastic_magic.wire.payload import build_payload
    spec = em.JobSpec.create(2, backend="gloo", log_dir=sys.argv[1])
    job = em.Job(spec, build_payload("import time\\nprint('up', flush=True)\\ntime.sleep(600)",
                                     spec)).start()
    while not job.status_snapshot.pids:
        time.sleep(0.05)
    print(*warm_pool().pids, flush=True)
    time.sleep(600)
""")


def test_a_pool_dies_with_its_owner(log_dir):
    """SIGKILL the process that owns a pool while a job of it runs: no zygote, shepherd or
    worker is left."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(log_dir)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        zygote = int(owner.stdout.readline())
        deadline = time.monotonic() + 60
        while len(job_processes()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(job_processes()) == 4  # two shepherds, two workers
        assert psutil.Process(zygote).name() == ZYGOTE
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while (psutil.pid_exists(zygote) or job_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(zygote) and not job_processes()
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()


def test_many_cells_from_the_pool_leak_nothing(log_dir):
    """30 cells: descriptors, threads and child processes are back where they were."""
    me = psutil.Process()

    def cell() -> None:
        result = em.launch("import torch.distributed as dist\ndist.barrier()\n1", nproc=2,
                           backend="gloo", log_dir=log_dir, render=lambda e: None)
        assert result.values == {0: 1, 1: 1}

    def held() -> tuple[list[str], list[str], list[int]]:
        """Our descriptors (what each is), threads and children: named, so a difference
        says what it is (one run in CI ended with a descriptor fewer than it began)."""
        return descriptors(), sorted(t.name for t in threading.enumerate()), \
            sorted(c.pid for c in me.children())

    for _ in range(3):  # the pool, torch's and logging's once-only state
        cell()
    # What earlier tests left to the cyclic collector goes now, not during the cells (a
    # memory file held so, closed by a collection mid-way, once showed as a descriptor
    # fewer); and with the collector off, what a cell leaves in a cycle stays counted.
    gc.collect()
    before = held()
    gc.disable()
    try:
        for _ in range(30):
            cell()
        after = held()
    finally:
        gc.enable()
    changed = [(sorted(set(b) - set(a)), sorted(set(a) - set(b)))
               for b, a in zip(before, after, strict=True)]
    assert [len(x) for x in after] == [len(x) for x in before], changed  # (gone, new)
    (zygote,) = [child for child in me.children() if child.name() == ZYGOTE]
    _wait_for_spares(2)  # refilled: the last of them half a second after the first
    idle = zygote.cpu_times()
    time.sleep(1.0)
    assert zygote.cpu_times() == idle  # an idle pool blocks: no CPU at all


def test_load_ext_starts_the_pool_no_pool_bypasses_it_unload_ext_ends_it(ip):
    """%load_ext starts the zygote for the usual job (several workers), and such a cell
    uses it; --no-pool leaves it alone; %unload_ext ends it."""
    ip.run_line_magic("unload_ext", "elastic_magic")
    assert not _zygotes()
    ip.run_line_magic("load_ext", "elastic_magic")
    deadline = time.monotonic() + 120
    while not warm_pool().pids and time.monotonic() < deadline:
        time.sleep(0.05)
    prewarmed = warm_pool().pids
    assert len(prewarmed) == 1
    ip.run_cell_magic("elastic", "--nproc 2 --backend gloo", "1")
    ip.run_cell_magic("elastic", "--nproc 1 --no-pool", "1")
    assert warm_pool().pids == prewarmed and [z.pid for z in _zygotes()] == prewarmed
    ip.run_line_magic("unload_ext", "elastic_magic")
    assert not _zygotes()
    ip.run_line_magic("load_ext", "elastic_magic")


def _alive(pid: int, started: float) -> bool:
    try:
        return psutil.Process(pid).create_time() == started
    except psutil.NoSuchProcess:
        return False
