"""Real jobs through the Python API: real workers, real torch (gloo), real c10d rendezvous."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from conftest import KILL_OWN_SHEPHERD, tagged_workers

import elastic_magic as em
from elastic_magic.result import JobResult, RankFailure, describe_failure, is_consequence
from elastic_magic.result_parts import Unpicklable
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import (
    JobFinished,
    JobState,
    Output,
    RanksRunning,
    RendezvousCompleted,
    Restarting,
    StateChanged,
    WorkerFailed,
    WorkersStarted,
)
from elastic_magic.wire.payload import build_payload

ALLREDUCE = """
import torch, torch.distributed as dist
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
t.item()
"""


def test_cell_runs_on_two_ranks_with_values(log_dir, recorder):
    lines = "for i in range(200):\n    print(f'line {i}', flush=i % 10 == 0)  # in batches\n"
    result = em.launch(lines + ALLREDUCE, nproc=2, log_dir=log_dir, render=recorder)
    assert result.ok and result.world_size == 2
    assert result.values == {0: 3.0, 1: 3.0}
    assert result.restarts == 0 and result.failure is None
    states = [e.state for e in recorder.of(StateChanged)]
    assert states[0] is JobState.RENDEZVOUS and states[-1] is JobState.SUCCEEDED
    assert JobState.RUNNING in states
    (rdzv,) = recorder.of(RendezvousCompleted)
    assert rdzv.world_size == 2 and rdzv.nnodes == 1 and rdzv.master_addr == "127.0.0.1"
    assert len(recorder.of(WorkersStarted)[0].pids) == 2
    assert isinstance(recorder.events[-1], JobFinished)
    # The agent's own events come from one thread, in order; each rank's lines come in
    # order per stream (the streams are separate pipes, so not in order with the rest).
    times = [e.time for e in recorder.events if not isinstance(e, Output)]
    assert times == sorted(times)
    for rank in (0, 1):
        assert recorder.lines(rank) == [f"line {i}" for i in range(200)]
    for key in {(e.rank, e.stream) for e in recorder.of(Output)}:
        times = [e.time for e in recorder.of(Output) if (e.rank, e.stream) == key]
        assert times == sorted(times), key


def test_the_pids_shown_are_those_of_the_processes_that_run_the_cell(log_dir, recorder,
                                                                      tmp_path):
    """status()["pids"] and the timeline name the process each rank's cell runs in (its
    os.getpid(): the one people give kill, py-spy and top), not the shepherd above it."""
    go = tmp_path / "go"
    cell = "import os, time\nwhile not os.path.exists(GO):\n    time.sleep(0.02)\nos.getpid()"
    spec = em.JobSpec.create(2, log_dir=log_dir)
    job = em.Job(spec, build_payload(cell, spec, namespace={"GO": str(go)})).start()
    deadline = time.monotonic() + 60
    while len(job.status()["pids"]) < 2 and not job.done and time.monotonic() < deadline:
        time.sleep(0.02)
    shown, shepherds = job.status()["pids"], dict(job.status_snapshot.shepherds)
    parents = {rank: psutil.Process(pid).ppid() for rank, pid in shown.items()}
    go.touch()
    result = job.wait(recorder)
    assert shown == result.values and len(shown) == 2
    assert parents == shepherds  # each rank's shepherd, shown apart (status_snapshot)
    (running,) = recorder.of(RanksRunning)
    assert dict(zip(running.ranks, running.pids, strict=True)) == result.values
    assert describe(running).text == (f"ranks 0, 1 run the cell "
                                      f"(pids {result.values[0]}, {result.values[1]})")
    assert job.status()["pids"] == {}  # none runs any more


def test_standalone_job_listens_on_loopback_only(log_dir):
    """The rendezvous store and the per-round worker store bind 127.0.0.1, never every
    interface (torch's default for a store given only a port)."""
    import psutil

    def listening_ports():
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                if c.status == psutil.CONN_LISTEN}

    before = listening_ports()
    spec = em.JobSpec.create(2, log_dir=log_dir)
    job = em.Job(spec, build_payload("import time\ntime.sleep(3)\n", spec, namespace={}))
    job.start()
    try:
        deadline = time.monotonic() + 60
        while job.state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        opened = listening_ports() - before
    finally:
        job.stop()
        job.wait()
    assert len(opened) >= 2, opened  # the rendezvous store and this round's worker store
    assert {ip for ip, _ in opened} == {"127.0.0.1"}, opened


def test_function_target_with_arguments(log_dir):
    def scaled_rank(factor, offset=0):
        import torch.distributed as dist

        return dist.get_rank() * factor + offset

    result = em.launch(scaled_rank, args=(10,), kwargs={"offset": 1}, nproc=3,
                       log_dir=log_dir, render=lambda events: None)
    assert result.values == {0: 1, 1: 11, 2: 21}


# One write(2) per line: torchrun's two workers share one stdout pipe, and a line printed
# through Python's buffer can reach it in pieces that interleave with the other rank's.
PROBE = """
import json, os
base = set(json.loads(os.environ["PROBE_BASE"]))
line = "PROBE " + json.dumps({k: v for k, v in os.environ.items() if k not in base}) + "\\n"
os.write(1, line.encode())
"""


def _probe_envs(lines: list[str]) -> dict[int, dict[str, str]]:
    envs = [json.loads(line.split("PROBE ", 1)[1]) for line in lines if "PROBE " in line]
    return {int(env["RANK"]): env for env in envs}


def test_torchrun_contract_matches_torchrun(tmp_path, log_dir, recorder):
    """The same probe under torchrun --standalone and under elastic_magic."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PROBE_BASE"] = json.dumps([*env, "PROBE_BASE"])
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    theirs = _probe_envs(torchrun.stdout.splitlines())
    old = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        em.launch(PROBE, nproc=2, log_dir=log_dir, render=recorder, init_process_group=False)
    finally:
        os.environ.clear()
        os.environ.update(old)
    ours = {r: _probe_envs(recorder.lines(r))[r] for r in (0, 1)}
    # torchrun's own agent setting leaks into its workers' env; it is no worker contract.
    agent_only = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "_"}
    # We add these: lines arrive as printed; a worker slot's identity (policy.Membership);
    # a standalone job's process groups kept on loopback; init_process_group returns once
    # every rank's group is up
    ours_only = {"PYTHONUNBUFFERED", "ELASTIC_MAGIC_SLOT", "GLOO_SOCKET_IFNAME",
                 "NCCL_SOCKET_IFNAME", "TORCH_DIST_INIT_BARRIER"}
    for rank in (0, 1):
        assert set(theirs[rank]) - agent_only == set(ours[rank]) - ours_only
        same_meaning = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                        "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                        "OMP_NUM_THREADS"]
        assert {k: ours[rank][k] for k in same_meaning} == {
            k: theirs[rank][k] for k in same_meaning}
        assert ours[rank]["MASTER_PORT"].isdigit()
        assert ours[rank]["TORCH_DIST_INIT_BARRIER"] == "1"
        assert ours[rank]["ELASTIC_MAGIC_SLOT"] == ours[rank]["LOCAL_RANK"]  # none left out
        assert ours[rank]["TORCHELASTIC_ERROR_FILE"].endswith(f"rank_{rank}/error.json")
    assert ours[0]["TORCHELASTIC_RUN_ID"] == ours[1]["TORCHELASTIC_RUN_ID"]


def test_cell_runs_as_main_with_kernel_cwd_path_and_argv(tmp_path, monkeypatch, log_dir):
    (tmp_path / "localmod.py").write_text("def answer():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cell = textwrap.dedent("""
        import os, sys, localmod

        class Point:
            def __init__(self, x):
                self.x = x

        if __name__ == "__main__":
            main_ran = True
        (__name__, main_ran, os.getcwd(), sys.argv, localmod.answer(), Point(3).x)
    """)
    result = em.launch(cell, nproc=2, argv=["--lr", "0.1"], log_dir=log_dir,
                       render=lambda e: None)
    assert result.values[0] == ("__main__", True, str(tmp_path), ["<cell>", "--lr", "0.1"], 42, 3)


def test_output_is_complete_ordered_and_logged(log_dir, recorder):
    cell = textwrap.dedent("""
        import sys, torch.distributed as dist
        r = dist.get_rank()
        for i in range(3000):
            print(f"out {r} {i}")
            if i % 100 == 0:
                print(f"err {r} {i}", file=sys.stderr)
        print("no newline at the end", end="")
    """)
    result = em.launch(cell, nproc=2, log_dir=log_dir, render=recorder)
    for rank in (0, 1):
        out = recorder.lines(rank)
        assert out == [f"out {rank} {i}" for i in range(3000)] + ["no newline at the end"]
        assert recorder.lines(rank, "stderr") == [f"err {rank} {i}" for i in range(0, 3000, 100)]
        logged = result.log_path(rank).read_text().splitlines()
        assert logged == out
        assert result.log_path(rank, "stderr").read_text().count("err") == 30
        assert result.tails[rank][-1] == "no newline at the end"
    assert result.log_path(0).parent == log_dir / result.run_id / "group_0" / "rank_0"


def test_root_cause_is_first_failure_with_cell_line(log_dir, recorder):
    cell = textwrap.dedent("""
        import torch.distributed as dist
        dist.barrier()
        if dist.get_rank() == 1:
            value = {"a": 1}
            value["missing"]
        dist.barrier()
    """)
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, timeout=600, log_dir=log_dir, render=recorder)
    result = err.value.result
    assert result.state is JobState.FAILED
    root = result.failure
    assert root.rank == 1 and root.exc_type == "KeyError" and root.message == "'missing'"
    assert root.cell_line == 6 and root.source_line == 'value["missing"]'
    assert "Cell line 6" in root.traceback and "runner.py" not in root.traceback
    # rank 0 was blocked in a collective: torn down by the agent, or (on a loaded machine,
    # 1 full run of 2 this stop) its barrier failed first on the lost peer: then it comes
    # after the root cause, as a consequence, never as a cause
    assert [f.rank for f in result.failures][:1] == [1], result.failures
    assert all(f.rank == 0 and is_consequence(f) for f in result.failures[1:]), result.failures
    assert result.duration < 120, "the group must not wait for the collective timeout"
    text = str(err.value)
    assert text.startswith("Rank 1 failed first") and 'value["missing"]' in text
    assert recorder.of(WorkerFailed)[0].failure == root


def test_identical_failures_are_grouped(log_dir, recorder):
    """The same error raised on different ranks has one signature: described once, with the
    other ranks listed. One rank fails per attempt, a different one each time (the others wait
    in a barrier, and the teardown stops rather than fails them): several ranks raising in one
    attempt race the teardown, which ends the others as soon as the first report arrives."""
    cell = textwrap.dedent("""
        import os, torch.distributed as dist
        if dist.get_rank() == int(os.environ["TORCHELASTIC_RESTART_COUNT"]):
            raise RuntimeError("same everywhere")
        dist.barrier()
    """)
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=3, max_restarts=2, log_dir=log_dir, render=recorder)
    result = err.value.result
    roots = [e.root_cause for e in recorder.of(Restarting)] + [result.failure]
    assert [f.rank for f in roots] == [0, 1, 2] and [f.attempt for f in roots] == [0, 1, 2]
    assert {f.message for f in roots} == {"same everywhere"}
    assert len({f.signature for f in roots}) == 1
    text = describe_failure(dataclasses.replace(result, failure=roots[0], failures=roots))
    assert text.startswith("Rank 0 failed first")
    assert text.count("Traceback (most recent call last)") == 1
    assert "Ranks 1, 2 also failed: the same error" in text


def test_failure_text_groups_by_signature():
    def failure(rank, when, message="boom"):
        return RankFailure(rank=rank, local_rank=rank, attempt=0, pid=100 + rank, time=when,
                           exc_type="ValueError", message=message,
                           traceback=f"Traceback (most recent call last):\nValueError: {message}\n")

    failures = [failure(2, 3.0), failure(0, 1.0), failure(1, 2.0), failure(3, 4.0, "other")]
    result = JobResult(run_id="em-x", state=JobState.FAILED, world_size=4, restarts=0,
                       max_restarts=0, duration=1.0, log_dir=__import__("pathlib").Path("/l"),
                       failure=failures[1], failures=failures)
    text = describe_failure(result)
    assert text.startswith("Rank 0 failed first")
    assert "Ranks 1, 2 also failed: the same error" in text
    assert "Rank 3 also failed: ValueError: other" in text
    assert text.count("Traceback (most recent call last):\nValueError: boom") == 1


def test_exit_code_and_signal_failures(log_dir):
    cell = "import os, torch.distributed as dist\nif dist.get_rank() == 1:\n    os._exit(3)\n"
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, log_dir=log_dir, render=lambda e: None)
    assert err.value.result.failure.exit_code == 3
    assert "exited with code 3" in str(err.value)

    cell = ("import os, signal, torch.distributed as dist\ndist.barrier()\n"
            "if dist.get_rank() == 0:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            "dist.barrier()\n")
    with pytest.raises(em.JobFailedError) as err:
        em.launch(cell, nproc=2, log_dir=log_dir, render=lambda e: None)
    root = err.value.result.failure
    assert root.rank == 0 and root.signal == "SIGKILL"
    assert "killed by SIGKILL" in str(err.value)



def test_a_rank_whose_shepherd_was_killed_is_the_root_cause(log_dir):
    """The shepherd's exit is the first sign of the rank's end; its worker's pipe closes
    only in the teardown, which must not make the rank look stopped by it."""
    with pytest.raises(em.JobFailedError) as err:
        em.launch(KILL_OWN_SHEPHERD, nproc=2, log_dir=log_dir, render=lambda e: None)
    result = err.value.result
    assert [(f.rank, f.signal) for f in result.failures] == [(1, "SIGKILL")]
    assert str(err.value).startswith("Rank 1 failed first")
    assert not tagged_workers()


RESTART_CELL = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from datetime import timedelta
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # The workers' store as torch's env:// reaches it: a key an earlier group left in it
    # would meet this group (what torchrun's stock restarts run into).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=30))
    fresh = not store.check(["left by an earlier group"])
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    print(f"attempt {attempt} allreduce {t.item()} fresh store {fresh}")
    dist.barrier()  # both ranks have looked and printed before the key is left
    store.set("left by an earlier group", "x")
    dist.barrier()  # both ranks have printed before one of them crashes
    if attempt < CYCLES and dist.get_rank() == attempt % dist.get_world_size():
        raise RuntimeError(f"crash in attempt {attempt}")
    dist.barrier()
    attempt
""")


def test_twenty_crash_and_restart_cycles_all_succeed(log_dir, recorder):
    """torchrun's stock restarts fail about half the time here (shared store keys)."""
    cycles = 20
    result = em.launch(RESTART_CELL, namespace={"CYCLES": cycles}, nproc=2,
                       max_restarts=cycles, log_dir=log_dir, render=recorder)
    assert result.ok and result.restarts == cycles
    assert result.values == {0: cycles, 1: cycles}
    for attempt in range(cycles + 1):
        for rank in (0, 1):  # every attempt met a fresh worker store
            assert f"attempt {attempt} allreduce 3.0 fresh store True" in recorder.lines(rank)
    started = recorder.of(WorkersStarted)
    assert [e.restart_count for e in started] == list(range(cycles + 1))


def test_stop_while_running_ends_every_worker(log_dir, recorder):
    spec = em.JobSpec.create(2, log_dir=log_dir)
    from elastic_magic.wire.payload import build_payload

    job = em.Job(spec, build_payload("import time\nprint('up')\ntime.sleep(600)", spec))
    job.start()
    seen_running = threading.Event()

    def watch(events):
        recorder(events)
        if any(getattr(e, "state", None) is JobState.RUNNING for e in events):
            seen_running.set()
            job.stop("test")

    result = job.wait(watch)
    assert seen_running.is_set()
    assert result.state is JobState.STOPPED and result.stop_reason == "test"
    assert not tagged_workers()


def test_a_renderer_that_raises_stops_the_job_before_the_error_surfaces(log_dir):
    """Nobody watches a job whose output failed (a broken frontend, a failed assertion in a
    test's renderer): it is stopped and has ended when the error reaches the caller."""
    from elastic_magic.wire.payload import build_payload

    spec = em.JobSpec.create(2, log_dir=log_dir)
    job = em.Job(spec, build_payload("import time\ntime.sleep(600)", spec)).start()

    def broken(events):
        if any(getattr(e, "state", None) is JobState.RUNNING for e in events):
            raise ValueError("the frontend went away")

    with pytest.raises(ValueError, match="frontend went away"):
        job.wait(broken)
    assert job.done and job.state is JobState.STOPPED
    assert job.result is not None and job.result.stop_reason == "the cell's output failed"
    assert not tagged_workers()


def test_values_that_cannot_travel_and_pulled_variables(log_dir):
    cell = ("import threading, torch.distributed as dist\n"
            "model = {'w': dist.get_rank()}\nthreading.Lock()\n")
    result = em.launch(cell, nproc=2, pull=["model", "nope"], log_dir=log_dir,
                       render=lambda e: None)
    assert isinstance(result.values[0], Unpicklable) and "lock" in result.values[0].reason
    assert result.pulled == {"model": {"w": 0}} and result.missing_pulls == ["nope"]


def test_no_init_leaves_process_group_to_the_cell(log_dir):
    cell = textwrap.dedent("""
        import torch.distributed as dist
        before = dist.is_initialized()
        dist.init_process_group("gloo")
        (before, dist.get_world_size())
    """)
    result = em.launch(cell, nproc=2, init_process_group=False, log_dir=log_dir,
                       render=lambda e: None)
    assert result.values == {0: (False, 2), 1: (False, 2)}


def test_env_flag_reaches_workers(log_dir):
    result = em.launch("import os\nos.environ['MY_FLAG'], os.environ['OMP_NUM_THREADS']",
                       nproc=1, env=["MY_FLAG=on", "OMP_NUM_THREADS=3"], log_dir=log_dir,
                       render=lambda e: None)
    assert result.values[0] == ("on", "3")


def test_stop_before_the_rendezvous_starts_nothing(log_dir, recorder):
    spec = em.JobSpec.create(2, log_dir=log_dir)
    from elastic_magic.wire.payload import build_payload

    job = em.Job(spec, build_payload("x = 1", spec))
    job.stop("early")
    result = job.start().wait(recorder)
    assert result.state is JobState.STOPPED and not recorder.of(WorkersStarted)


STORM = textwrap.dedent("""
    import os, signal, sys, threading, time
    signal.signal(signal.SIGINT, lambda *a: None)  # this 'kernel' shrugs off its Ctrl-Cs
    import elastic_magic as em
    stop = threading.Event()

    def storm():  # Ctrl-C after Ctrl-C to our whole process group, as Jupyter sends them
        while not stop.is_set():
            os.killpg(os.getpgid(0), signal.SIGINT)
            time.sleep(0.001)

    threading.Thread(target=storm, daemon=True).start()
    results = [em.launch("x = 1", nproc=4, log_dir=sys.argv[1], check=False,
                         render=lambda e: None).state.value for _ in range(3)]
    stop.set()
    print(results)
""")


def test_ctrl_c_meant_for_the_kernel_cannot_kill_workers_being_spawned(log_dir):
    """A worker is in the kernel's process group from fork until setsid; SIGINT sent to
    that group then must not reach it (the agent thread spawns with SIGINT blocked)."""
    done = subprocess.run([sys.executable, "-c", STORM, str(log_dir)], capture_output=True,
                          text=True, timeout=240, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['succeeded', 'succeeded', 'succeeded']", done.stdout


IGNORING = textwrap.dedent("""
    import json, signal, sys
    # A kernel started in the background (``jupyter lab &``) ignores SIGINT; a joined
    # machine's agent leaving at a commit ignores SIGTERM. What a process ignores, the
    # processes it execs ignore too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import elastic_magic as em
    from elastic_magic.wire.payload import build_payload
    from elastic_magic.result import JobState

    HANDLERS = (
        "import signal\\n"
        "ignored = int([line.split()[1] for line in open('/proc/self/status')\\n"
        "               if line.startswith('SigIgn')][0], 16)\\n"
        "(signal.getsignal(signal.SIGINT) is signal.default_int_handler,\\n"
        " bool(ignored & (1 << signal.SIGINT - 1 | 1 << signal.SIGTERM - 1)))")
    handlers = [em.launch(HANDLERS, nproc=1, pool=pool, log_dir=sys.argv[1],
                          render=lambda e: None).values[0] for pool in (True, False)]
    spec = em.JobSpec.create(2, log_dir=sys.argv[1])
    job = em.Job(spec, build_payload("import time\\nprint('up', flush=True)\\n"
                                     "time.sleep(600)", spec)).start()

    def stop_once_running(events):
        if any(getattr(e, "state", None) is JobState.RUNNING for e in events):
            job.stop("test")

    result = job.wait(stop_once_running)
    print(json.dumps({"handlers": handlers, "state": result.state.value,
                      "stderr": [result.log_path(r, "stderr").read_text() for r in (0, 1)]}))
""")


def test_ranks_take_interrupts_even_where_the_kernel_ignores_them(log_dir):
    """The ranks' SIGINT and SIGTERM actions are their own: a stop interrupts the cell
    (KeyboardInterrupt, not the SIGTERM that follows when it does not come back), also
    when the kernel was started ignoring both."""
    done = subprocess.run([sys.executable, "-c", IGNORING, str(log_dir)], capture_output=True,
                          text=True, timeout=240, start_new_session=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["handlers"] == [[True, False], [True, False]]  # from the pool; fresh
    assert report["state"] == "stopped"
    assert report["stderr"] == ["KeyboardInterrupt: stopped\n"] * 2


def test_a_finished_job_or_session_leaves_nothing_for_the_garbage_collector(log_dir):
    """The kernel keeps finished jobs' handles (`%elastic jobs`); what the agent held (its
    engine, loop, payload: a cell's globals) must go when it ends, not when the collector
    next runs a full pass (a notebook's RSS grew by a payload every few cells)."""
    import collections
    import gc

    spec = em.JobSpec.create(1, log_dir=log_dir)
    gc.collect()
    gc.disable()
    try:
        job = em.Job(spec, build_payload("len(big)", spec, namespace={"big": b"x" * 1024})).start()
        assert job.wait(lambda events: None).ok
        session = em.Session(1, log_dir=log_dir, render=lambda events: None)
        session.run("x = 1")
        session.stop()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = collections.Counter(type(o).__qualname__ for o in gc.garbage
                                   if type(o).__module__.startswith("elastic_magic.agent"))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert job.result is not None and not ours, ours
