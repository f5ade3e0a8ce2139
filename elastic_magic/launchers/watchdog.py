"""The launchers' watchdog: cancels a job's allocations if the kernel dies before it could.

The kernel starts the watchdog (``interpreter.command``: never ``python -m``, which would
import from the kernel's working directory) in a session of its own (a kernel killed with
its process group leaves it running) with its stdin a pipe that only the kernel writes. The
kernel sends one JSON line per change: ``{"add": ID, "run": [ARGV, ...]}`` when an
allocation starts, or before a submission whose id is not known yet (what would end it),
``{"drop": ID}`` when it was ended normally, ``{"remove": PATH}`` for a file of the job's
(the Slurm token, named before it is written), ``{"exit": true}`` when the job has ended
cleanly, ``{"finish": true}`` when the kernel could not confirm the end of some (what is
held is run now, as at the kernel's death). If the kernel dies first (its pidfd says so even
while a child it forked still holds the pipe) or stdin ends without ``exit``, the files are
removed, the submissions still under way end first (``sbatch`` holds the write end of a
second pipe, ``submitting``: its end is theirs), then every command still held is run until
it succeeds (the scheduler confirmed it), retried with a growing delay for up to
``PATIENCE`` seconds, and the watchdog exits. Nothing here reads anything but those pipes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import IO, Any

from ..agent.node import interpreter

PATIENCE = 600.0  # seconds a command is retried for (a scheduler that times out, say)
FIRST_RETRY = 1.0  # then doubled, up to LONGEST_RETRY
LONGEST_RETRY = 60.0


def watch(lines: Iterable[str]) -> tuple[list[list[str]], list[str], bool]:
    """What is still to be run and removed when ``lines`` end without ``exit``, and
    whether the kernel said ``finish`` (it lives: no submission of its is under way)."""
    held: dict[str, list[list[str]]] = {}
    files: list[str] = []
    for line in lines:
        try:
            order: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if order.get("exit"):
            return [], [], False
        if order.get("finish"):
            break
        if "add" in order:
            held[str(order["add"])] = [[str(word) for word in argv] for argv in order["run"]]
        elif "drop" in order:
            held.pop(str(order["drop"]), None)
        elif "remove" in order and str(order["remove"]) not in files:
            files.append(str(order["remove"]))
    else:
        return [argv for commands in held.values() for argv in commands], files, False
    return [argv for commands in held.values() for argv in commands], files, True


def kernel_lines(stdin: int, kernel: int) -> Iterator[str]:
    """The kernel's lines until its pipe ends or the kernel (this process's parent, PID
    ``kernel``) is gone; then what it wrote before is still read, without waiting for the
    pipe's end."""
    gone = False
    try:
        pidfd: int | None = os.pidfd_open(kernel)
        gone = os.getppid() != kernel  # it died first: the pid may be another's now
    except ProcessLookupError:
        pidfd, gone = None, True
    except OSError:  # a Linux before 5.3: the pipe alone
        pidfd = None
    pending = b""
    while True:
        if not gone:
            watched = [stdin] if pidfd is None else [stdin, pidfd]
            gone = pidfd in select.select(watched, [], [])[0]
        if gone:
            os.set_blocking(stdin, False)
        try:
            chunk = os.read(stdin, 1 << 16)
        except BlockingIOError:
            chunk = b""
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        yield from (line.decode(errors="replace") for line in lines)


def submissions_ended(fd: int, patience: float) -> bool:
    """Whether every process that held the write end of pipe ``fd`` (the kernel and the
    ``sbatch`` it was running) has closed it, waiting up to ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0] and not os.read(fd, 1 << 10):
            return True
    return False


def succeeded(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_until_done(commands: list[list[str]], patience: float = PATIENCE) -> list[list[str]]:
    """Each command run until it succeeds, retried with a doubling delay while the next
    try starts within ``patience`` seconds; those that never did."""
    deadline = time.monotonic() + patience
    delay = FIRST_RETRY
    while True:
        commands = [argv for argv in commands if not succeeded(argv)]
        if not commands or time.monotonic() + delay > deadline:
            return commands
        time.sleep(delay)
        delay = min(delay * 2, LONGEST_RETRY)


def main() -> int:
    commands, files, finishing = watch(kernel_lines(0, int(sys.argv[1])))
    for path in files:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if commands and not finishing and len(sys.argv) > 2:
        # an sbatch the kernel started may still submit: cancel once it has ended
        submissions_ended(int(sys.argv[2]), PATIENCE)
    return 1 if run_until_done(commands) else 0


class Watchdog:
    """The kernel's side: starts the watchdog, tells it what to end, lets it go."""

    def __init__(self) -> None:
        ended, holding = os.pipe()  # the submissions' pipe (see ``submitting``)
        try:
            self.proc = subprocess.Popen(
                interpreter.command(__name__, str(os.getpid()), str(ended)),
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, text=True, pass_fds=(ended,),
                env={k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"})
        except BaseException:
            os.close(holding)
            raise
        finally:
            os.close(ended)
        assert self.proc.stdin is not None
        lifeline(self.proc.stdin)
        self.holding = os.fdopen(holding, "wb")
        lifeline(self.holding)
        _HOLDING.add(self.holding)

    def _send(self, order: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(json.dumps(order) + "\n")
            self.proc.stdin.flush()

    def add(self, allocation_id: str, commands: list[list[str]]) -> None:
        if commands:
            self._send({"add": allocation_id, "run": commands})

    def drop(self, allocation_id: str) -> None:
        self._send({"drop": allocation_id})

    def remove(self, path: str) -> None:
        """``path`` is removed if the kernel dies, whatever the allocations."""
        self._send({"remove": path})

    def close(self) -> None:
        """The job ended cleanly: the watchdog exits without running anything."""
        self._send({"exit": True})
        self._let_go()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def finish(self) -> None:
        """Some allocations' end is not confirmed: the watchdog runs what it holds now,
        retrying for minutes on its own, and exits; the kernel does not wait for it."""
        self._send({"finish": True})
        self._let_go()

    def _let_go(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(OSError):
            self.holding.close()


# The write ends of the live watchdogs' submissions pipes: a submission (``sbatch``) holds
# them while it runs, so a watchdog whose kernel died waits for it before cancelling.
_HOLDING: weakref.WeakSet[IO[Any]] = weakref.WeakSet()


def submitting() -> tuple[int, ...]:
    """The descriptors a submission's process inherits (``pass_fds``) for its run."""
    fds = []
    for pipe in list(_HOLDING):
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
            fds.append(pipe.fileno())
    return tuple(fds)


# Pipes whose end tells a process that the kernel is gone (the watchdog's stdin, an ssh
# join's). A child the kernel forks (a cell's multiprocessing pool) would keep them open:
# in the child, each becomes /dev/null.
_LIFELINES: weakref.WeakSet[IO[Any]] = weakref.WeakSet()


def lifeline(pipe: IO[Any]) -> None:
    """Only this process holds ``pipe``'s write end, not the children it forks."""
    _LIFELINES.add(pipe)


def _let_go_in_child() -> None:
    for pipe in list(_LIFELINES):
        with contextlib.suppress(OSError, ValueError):  # ValueError: closed meanwhile
            fd = pipe.fileno()
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            # the file object stays valid (its writes go nowhere), its descriptor number too
            os.dup2(null, fd, inheritable=False)
            os.close(null)


os.register_at_fork(after_in_child=_let_go_in_child)
