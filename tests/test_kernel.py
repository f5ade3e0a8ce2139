"""Interrupts and kernel death in a real Jupyter kernel: no worker may survive."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
from conftest import (
    FORK_STUBBORN_CHILDREN,
    forked_children,
    survivors,
    tagged_workers,
    wait_for_workers,
    wait_until_no_workers,
)
from jupyter_client.manager import start_new_kernel

pytestmark = pytest.mark.kernel

LONG_CELL = """%%elastic --nproc 2 --max-restarts 1 --text
import os, time, torch.distributed as dist
if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == 0 and dist.get_rank() == CRASH_RANK:
    raise RuntimeError("crash before the long run")
print("working", flush=True)
time.sleep(600)
"""


@pytest.fixture
def kernel():
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext elastic_magic\nimport torch")
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def execute(kc, code: str, trigger: str | None = None, action: Callable[[], None] | None = None,
            timeout: float = 120) -> tuple[dict, str]:
    """Run ``code``; call ``action`` once ``trigger`` appears in the output."""
    msg_id = kc.execute(code)
    text = ""
    fired = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text += content["text"]
        elif kind == "error":
            text += f"{content['ename']}: {content['evalue']}\n"
        if trigger is not None and not fired and trigger in text:
            fired = True
            action()
        if kind == "status" and content["execution_state"] == "idle":
            break
    return _reply_to(kc, msg_id, timeout), text


def _reply_to(kc, msg_id: str, timeout: float) -> dict:
    """The shell reply to ``msg_id`` (replies to earlier requests are skipped)."""
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


@pytest.mark.parametrize(
    ("phase", "crash_rank", "trigger"),
    [
        ("starting", -1, "[elastic] rendezvous round 1"),  # workers still importing torch
        ("running", -1, "[rank 1] working"),
        ("restarting", 1, "[elastic] restarting the group"),
    ],
)
def test_interrupt_stops_every_worker(kernel, phase, crash_rank, trigger):
    km, kc = kernel
    execute(kc, f"CRASH_RANK = {crash_rank}")
    reply, text = execute(kc, LONG_CELL, trigger=trigger, action=km.interrupt_kernel)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
    assert "[elastic] stopped" in text
    assert not tagged_workers(), f"workers survived an interrupt while {phase}"
    reply, text = execute(kc, "print('kernel still usable')")  # the kernel carries on
    assert reply["status"] == "ok" and "still usable" in text


def test_interrupt_right_after_start(kernel):
    km, kc = kernel
    execute(kc, "CRASH_RANK = -1")
    msg_id = kc.execute(LONG_CELL)
    time.sleep(0.2)  # rendezvous or spawning, whichever the machine is at
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert not tagged_workers()


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_workers_die_with_the_kernel(kernel, how):
    km, kc = kernel
    execute(kc, "CRASH_RANK = -1")
    kc.execute(LONG_CELL)
    workers = wait_for_workers(2)
    assert len(workers) == 2
    if how == "killed":
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
    else:
        km.shutdown_kernel(now=False)
    left = wait_until_no_workers(timeout=5.0)
    assert not left, f"workers outlived the kernel ({how}): {[p.pid for p in left]}"


@pytest.mark.parametrize("how", ["killed", "shut down"])
def test_what_workers_forked_dies_with_the_kernel(kernel, tmp_path, how):
    """Children that ignore SIGINT and SIGTERM, one in a session of its own, end too."""
    km, kc = kernel
    execute(kc, f"PID_DIR = {str(tmp_path)!r}")
    kc.execute("%%elastic --nproc 2 --text\n" + FORK_STUBBORN_CHILDREN + "time.sleep(600)\n")
    deadline = time.monotonic() + 60
    while len(forked_children(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(forked_children(tmp_path)) == 4
    if how == "killed":
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
    else:
        km.shutdown_kernel(now=False)
    deadline = time.monotonic() + 5
    while survivors(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not survivors(tmp_path), f"forked children outlived the kernel ({how})"
    assert not wait_until_no_workers(timeout=5.0)


def collect(kc, code: str, timeout: float = 180) -> tuple[dict, list[dict], float]:
    """Run ``code``; every IOPub message it caused, and how long it took."""
    started = time.monotonic()
    msg_id = kc.execute(code)
    msgs = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msgs.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return _reply_to(kc, msg_id, timeout), msgs, time.monotonic() - started


def test_high_volume_output_reaches_logs_whole_and_frontend_batched(kernel, tmp_path):
    _km, kc = kernel
    ranks, per_rank = 4, 25_000  # 100k lines in total
    cell = (f"%%elastic --nproc {ranks} --log-dir {tmp_path} -o big\n"
            "import torch.distributed as dist\n"
            "r = dist.get_rank()\n"
            f"for i in range({per_rank}):\n"
            "    print(f'rank {r} line {i}')\n")
    reply, msgs, seconds = collect(kc, cell)
    assert reply["status"] == "ok"
    kinds = [m["msg_type"] for m in msgs]
    # Lines go to the dashboard, not as stream messages, and at a few updates per second.
    assert "stream" not in kinds
    updates = kinds.count("comm_msg")
    assert 1 <= updates <= 4 * seconds + 10, (updates, seconds)
    assert len(msgs) <= updates + 15
    final = [m["content"]["data"] for m in msgs if m["msg_type"] == "update_display_data"
             and "text/plain" in m["content"]["data"]][-1]  # not the panel's announcement
    assert "succeeded · world size 4" in final["text/plain"]
    assert f"{per_rank + 1 - 150} earlier lines in the log" not in final["text/plain"]
    assert f"{per_rank - 150} earlier lines in the log" in final["text/plain"]
    (run_dir,) = tmp_path.iterdir()
    for rank in range(ranks):
        logged = (run_dir / "group_0" / f"rank_{rank}" / "stdout.log").read_text()
        assert logged.splitlines() == [f"rank {rank} line {i}" for i in range(per_rank)]


def test_background_job_is_managed_with_line_magics(kernel):
    _km, kc = kernel
    reply, text = execute(kc, "%%elastic --bg --nproc 2 -o handle\n"
                              "import time\nprint('bg up', flush=True)\ntime.sleep(600)\n")
    assert reply["status"] == "ok"  # returned at once, the job running behind it
    deadline = time.monotonic() + 60
    logs = ""
    while "bg up" not in logs and time.monotonic() < deadline:
        time.sleep(0.3)
        _, logs = execute(kc, "%elastic logs 1")
    assert "[rank" not in logs and "bg up" in logs
    _, jobs = execute(kc, "%elastic jobs")
    assert "  1  em-" in jobs and "world size 2" in jobs
    _, status = execute(kc, "%elastic status 1")
    assert "state: running" in status and "pids: {0: " in status
    assert len(wait_for_workers(2)) == 2
    _, stopped = execute(kc, "%elastic stop")
    assert "stopped; its workers have exited" in stopped
    assert not tagged_workers()
    _, state = execute(kc, "print(handle.state.value, handle.result.stop_reason)")
    assert "stopped %elastic stop" in state
    reply, text = execute(kc, "%elastic logs 7")
    assert reply["status"] == "error" and "no stdout log for rank 7" in text


def test_scale_a_background_job_from_a_line_magic(kernel):
    _km, kc = kernel
    reply, _ = execute(kc, "%%elastic --bg --nproc 2 --max-nproc 3 -o resizable\n"
                           "import time, torch, torch.distributed as dist, elastic_magic\n"
                           "state = elastic_magic.State(step=0)\n"
                           "while state.step < 40:\n"
                           "    time.sleep(0.1)\n"
                           "    state.step += 1\n"
                           "    state.commit()\n"
                           "dist.get_world_size()\n")
    assert reply["status"] == "ok"
    execute(kc, "resizable.wait_for_commit(3, timeout=60)")
    reply, text = execute(kc, "%elastic scale 5")
    assert reply["status"] == "error" and "between 2 and 3 workers" in text
    reply, text = execute(kc, "%elastic scale 3")
    assert reply["status"] == "ok" and "resize to 3 workers requested" in text
    _, text = execute(kc, "resizable.wait_done(120)\n"
                          "print(resizable.result.values, resizable.result.resizes)")
    assert "{0: 3, 1: 3, 2: 3} 1" in text
