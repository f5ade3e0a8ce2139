"""The checkpoint folder after the kernel is SIGKILLed during commits: a checkpoint is one
atomic unit (the step printed on resume, JobResult.commit and the step the State restores
agree), and what an interrupted write left behind is removed at the next start.

The kernel is a real process (``elastic_magic.launch`` in a subprocess, its workers
training a 32 MB State that commits every step to ``--checkpoint-dir``), killed at several
moments: while a checkpoint is being written, just after one was renamed into place, and at
arbitrary times."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

CELL = textwrap.dedent("""
    import os, time, torch, elastic_magic
    weights = torch.nn.Linear(2048, 4096, bias=False)  # 32 MB
    with torch.no_grad():
        weights.weight.zero_()
    state = elastic_magic.State(model=weights, step=0)
    # The data and the step of one commit must agree: the weights hold the step.
    consistent = bool(torch.all(weights.weight == state.step))
    print(f"START step {state.step} consistent {consistent}", flush=True)
    while not os.path.exists(GO):
        time.sleep(0.01)
    while state.step < LIMIT:
        with torch.no_grad():
            weights.weight.add_(1)
        state.step += 1
        state.commit()
    (state.step, consistent)
""")

KERNEL = textwrap.dedent("""
    import sys, elastic_magic as em
    from pathlib import Path
    cell, ckpt, logs, go, limit = sys.argv[1:]
    result = em.launch(cell, nproc=1, checkpoint_dir=Path(ckpt), log_dir=Path(logs),
                       namespace={"GO": go, "LIMIT": int(limit)})
    print("RESULT", result.values[0], result.commit and result.commit["step"], flush=True)
""")


class Kernel:
    """A kernel-like process running one job; its output collected line by line."""

    def __init__(self, tmp_path: Path, limit: int, run: int) -> None:
        self.go = tmp_path / f"go{run}"
        self.ckpt = tmp_path / "ckpt"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", KERNEL, CELL, str(self.ckpt), str(tmp_path / "logs"),
             str(self.go), str(limit)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            assert self.proc.poll() is None or self._reader.is_alive(), self.output()
            time.sleep(0.01)
        raise AssertionError(f"no {pattern!r} in:\n{self.output()}")

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=30)

    def finish(self) -> str:
        self.proc.wait(timeout=120)
        self._reader.join(timeout=30)
        assert self.proc.returncode == 0, self.output()
        return self.output()


def temporaries(ckpt: Path) -> list[str]:
    return sorted(name for name in os.listdir(ckpt) if name.startswith("."))


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"


def resumed_consistently(kernel: Kernel) -> int:
    """The step the job printed it resumes from, checked against what the State restored;
    the leftovers of the killed job are gone by the time the cell runs."""
    start = kernel.wait_for(r"START step (\d+) consistent (\w+)")
    step, consistent = int(start[1]), start[2]
    assert consistent == "True", kernel.output()
    if step:
        printed = kernel.wait_for(r"resuming from the checkpoint of step (\d+)")
        assert int(printed[1]) == step, kernel.output()
    assert temporaries(kernel.ckpt) == [], kernel.output()  # nothing committed yet here
    return step


def killed_once(tmp_path: Path, run: int, moment: str) -> tuple[int, bool]:
    """Start a job, kill its kernel at ``moment``: the step it resumed from, and whether
    the kill interrupted a checkpoint write."""
    kernel = Kernel(tmp_path, limit=10**6, run=run)
    try:
        step = resumed_consistently(kernel)
        checkpoint = kernel.ckpt / "checkpoint.em"
        before = os.stat(checkpoint).st_ino if checkpoint.exists() else None
        kernel.go.touch()
        if moment == "mid-write":  # a temporary file exists: a write is under way
            wait_until(lambda: temporaries(kernel.ckpt))
        elif moment == "after-rename":  # a new checkpoint just replaced the last one
            wait_until(lambda: checkpoint.exists() and os.stat(checkpoint).st_ino != before)
        else:
            time.sleep(0.5 + 0.3 * run)
    finally:
        kernel.kill()
    return step, bool(temporaries(kernel.ckpt))


@pytest.mark.parametrize("kills", [("mid-write", "after-rename", "mid-write", "anytime")])
def test_a_kernel_killed_during_commits_leaves_one_checkpoint_and_no_leftovers(tmp_path,
                                                                              kills):
    (tmp_path / "ckpt").mkdir(mode=0o700)
    caught_mid_write = 0
    last = 0
    for run, moment in enumerate(kills):
        step, mid_write = killed_once(tmp_path, run, moment)
        assert step >= last  # never an older commit than one already resumed from
        caught_mid_write += mid_write
        last = step
    assert caught_mid_write  # the test did interrupt a write (and left a temporary file)

    final = Kernel(tmp_path, limit=0, run=len(kills))
    step = resumed_consistently(final)
    final.go.touch()
    output = final.finish()
    assert f"RESULT ({step}, True) {step}" in output  # restored == printed == JobResult.commit
    assert step >= last and step > 0
    assert temporaries(final.ckpt) == []


def test_a_second_job_on_the_folder_leaves_a_running_write_alone(tmp_path, log_dir,
                                                                  recorder):
    """Two jobs share a --checkpoint-dir (two notebooks): the second one's start removes
    what a crashed write left, never the temporary file the first job is writing, whose
    rename (its commit) then succeeds."""
    import elastic_magic as em
    from elastic_magic.agent.node.snapshots import temporary_file
    from elastic_magic.folders import own_folder

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    crashed = ".checkpoint.em.0123456789abcdef"
    (ckpt / crashed).write_bytes(b"half a checkpoint")  # no one is writing it
    folder = own_folder(ckpt, private=False)
    try:
        with temporary_file(folder, "checkpoint.em") as (fd, tmp):  # the first job's write
            os.write(fd, b"the first job's checkpoint")
            result = em.launch("1 + 1", nproc=1, checkpoint_dir=ckpt, log_dir=log_dir,
                               render=recorder)
            assert result.values[0] == 2
            assert temporaries(ckpt) == [tmp]  # the crashed write's file alone is gone
            os.replace(tmp, "checkpoint.em", src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)
    assert (ckpt / "checkpoint.em").read_bytes() == b"the first job's checkpoint"
