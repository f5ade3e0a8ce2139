"""The shepherd: everything a worker starts ends with it.

Frameworks fork their own processes in each rank (Lightning's ddp_notebook, DataLoader
workers, a shell a user starts); some ignore SIGINT and SIGTERM, some leave the worker's
process group (setsid). Signalling the worker's group misses those, and the worker itself
cannot be relied on to clean up: it may be SIGKILLed, stuck in a collective, or killed by
PR_SET_PDEATHSIG before any of its code runs. So the interpreter the agent spawns for a
rank forks at once, before torch and before any thread: the child becomes the worker, in a
process group of its own; the parent stays behind as its shepherd, a single-threaded loop
that runs no user code:

- It is a child subreaper (PR_SET_CHILD_SUBREAPER): a process below it whose parent exits
  (after setsid, a double fork, or the worker's own death) is re-parented to it, not to
  init, so every descendant is found by walking its children.
- It relays the agent's SIGINT and SIGTERM to the worker's process group (on a joined
  machine, a SIGTERM only from its agent: see ``TERM_FROM_VARIABLE``). On ``END_ALL``
  (the agent's last escalation step, and its own PR_SET_PDEATHSIG: the kernel died) it
  SIGKILLs the worker and every process below it.
- When the worker exits, however it exits, the shepherd tells the agent how at once (its
  wait status, on the rank's notice pipe), then SIGKILLs whatever the worker left
  running, reaps it all, and exits as the worker did (same code or signal). To the agent,
  the shepherd is the rank: its exit means nothing of the rank is left. The notice comes
  before that: a rank's DataLoader workers and the shepherd itself, forks of a process
  with torch loaded, take 10-15 ms each to end, and the agent need not wait for that to
  decide what the rank's end means.

Signals are taken synchronously (blocked, then ``sigtimedwait``), so the loop never runs
at an arbitrary point and never waits on a lock another thread holds.

Having forked the worker, the shepherd execs a bare interpreter on this file (stdlib
only): forked from a process with torch loaded, it would hold that image, and ending it
would take 10-15 ms just when the agent waits for the rank to be gone. Its blocked
signals, its parent, children, PR_SET_CHILD_SUBREAPER and PR_SET_PDEATHSIG carry over
exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import NoReturn

# The agent's request "SIGKILL the rank and everything below it now"; also what Linux
# sends the shepherd when the kernel's agent thread is gone (PR_SET_PDEATHSIG).
END_ALL = signal.SIGHUP
_TO_GROUP = (signal.SIGINT, signal.SIGTERM)  # interrupts, as a terminal sends them
_TO_WORKER = (signal.SIGUSR1, signal.SIGUSR2)  # for the rank itself (a handler of the cell)
_WATCHED = {signal.SIGCHLD, END_ALL, *_TO_GROUP, *_TO_WORKER}
_TICK = 1.0  # seconds between checks that the kernel is still there

# A scheduler (Slurm at a preemption or a cancel) sends SIGTERM to every process of the
# job, ranks included; on a joined machine that is its agent's to act on (it leaves at the
# next commit). Its join names its PID here: a rank then takes SIGTERM only from it,
# directly or relayed by the rank's shepherd.
TERM_FROM_VARIABLE = "ELASTIC_MAGIC_TERM_FROM"

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
NAME = "em-shepherd"  # its name in ps and top (the command line stays the worker's)


def _prctl(option: int, value: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def term_sender() -> int | None:
    """The PID whose SIGTERM alone ends a rank (its joined machine's agent), or None: any."""
    value = os.environ.get(TERM_FROM_VARIABLE, "")
    return int(value) if value.isdigit() else None


def _discard_pending(signals: tuple[signal.Signals, ...]) -> None:
    """Drop any of ``signals`` that arrived while blocked: the agent spawns with SIGINT
    and SIGTERM blocked, so one that reached us before we left the kernel's process group
    (a Ctrl-C meant for the kernel) waits here. Ignoring a signal discards it."""
    for sig in signals:
        previous = signal.signal(sig, signal.SIG_IGN)
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)


def discard_interrupts() -> None:
    """Drop a SIGINT or SIGTERM pending while they were blocked (a spare rank, waiting for
    its job, may have been sent one meant for no job of its own)."""
    _discard_pending(_TO_GROUP)


# On the rank's notice pipe: the worker's wait status, and when it was reaped (the time of
# its death, independent of how soon the agent reads its report pipe's end).
NOTICE = struct.Struct("!id")


def start(parent_pid: int, close_in_shepherd: tuple[int, ...], *, notice: int | None = None,
          notice_from: int | None = None) -> int:
    """Fork the worker. Returns in the worker only (the shepherd's PID); the shepherd
    watches until the rank has ended and exits. ``close_in_shepherd``: the worker's pipes
    to the agent, which must see EOF when the worker is gone. ``notice``: the rank's notice
    pipe (its write end); or ``notice_from``: a socket on which the worker hands it over
    once it has one (a spare's). Both are the shepherd's alone."""
    _discard_pending(_TO_GROUP)
    inherited = signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_PDEATHSIG, END_ALL)
    if os.getppid() != parent_pid:  # the kernel went before prctl took effect
        os._exit(1)
    shepherd = os.getpid()
    worker = os.fork()
    if worker == 0:
        os.setpgid(0, 0)  # the worker's group: what SIGINT and SIGTERM are relayed to
        signal.pthread_sigmask(signal.SIG_SETMASK, inherited)
        for fd in (notice, notice_from):
            if fd is not None:
                os.close(fd)
        return shepherd
    with contextlib.suppress(OSError):  # set here too, so no relay finds it missing
        os.setpgid(worker, worker)
    for fd in close_in_shepherd:
        os.close(fd)
    _shed_image(worker, parent_pid, notice, notice_from)
    _prctl(PR_SET_NAME, NAME.encode())  # exec failed: watch from this image
    _watch(worker, parent_pid, _notice_of(notice, notice_from))


def _shed_image(worker: int, parent_pid: int, notice: int | None,
                notice_from: int | None) -> None:
    """Exec a bare interpreter on this file, which goes on watching (``_main``); returns
    only if it cannot. Only stdio and the notice descriptors carry over."""
    kept = [fd for fd in (notice, notice_from) if fd is not None]
    if not (sys.executable and os.path.isfile(__file__)):
        return
    with contextlib.suppress(OSError):
        for fd in kept:
            os.set_inheritable(fd, True)
        os.execv(sys.executable, [sys.executable, "-I", "-S", __file__, str(worker),
                                  str(parent_pid), *(str(-1 if fd is None else fd)
                                                     for fd in (notice, notice_from))])
    for fd in kept:  # exec failed: they stay ours alone
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)


def _notice_of(notice: int | None, notice_from: int | None) -> Callable[[], int | None]:
    """Where the notice goes, asked for once the worker has ended: the pipe given, or
    the one the worker handed over since."""
    return (lambda: notice) if notice_from is None else (lambda: _handed(notice_from))


def _handed(sock_fd: int) -> int | None:
    """The notice pipe the worker handed over on ``sock_fd``, if it did."""
    with contextlib.suppress(OSError), socket.socket(fileno=sock_fd) as sock:
        sock.setblocking(False)  # recv_fds drops its flags argument (Python 3.11)
        _data, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
        return fds[0] if fds else None
    return None


def _notify(fd: int | None, status: int, reaped_at: float) -> None:
    """Tell the agent how and when the worker ended (one write: a pipe keeps it whole)."""
    if fd is not None:
        with contextlib.suppress(OSError):  # the agent is gone: nothing to tell
            os.write(fd, NOTICE.pack(status, reaped_at))


def _watch(worker: int, parent_pid: int, notice: Callable[[], int | None]) -> NoReturn:
    status: int | None = None  # the worker's wait status, once reaped
    agent = term_sender()
    while status is None:
        info = signal.sigtimedwait(_WATCHED, _TICK)
        sig = info.si_signo if info else None
        if info is not None and sig == signal.SIGTERM and agent is not None \
                and info.si_pid != agent:
            sig = None  # the scheduler's: the agent, which has it too, decides
        # The worker is not reaped yet: its PID, and so its group id, is still its own.
        with contextlib.suppress(ProcessLookupError):
            if sig in _TO_GROUP:
                os.killpg(worker, sig)
            elif sig in _TO_WORKER:
                os.kill(worker, sig)
        status = _reap(worker)
        if status is not None:
            _notify(notice(), status, time.time())
        elif sig == END_ALL or os.getppid() != parent_pid:
            break  # asked to, or the kernel is gone
    _exit_as(_end_all(worker, status))


def _reap(worker: int) -> int | None:
    """Reap every child that has exited (orphans re-parented to us included); the
    worker's wait status if it was one of them. A worker that ended takes its process
    group with it (a DataLoader's workers, say) while its PID is still its own (not yet
    reaped): one signal, and none of them outlives it waiting for its own watchdog."""
    with contextlib.suppress(ChildProcessError):
        if os.waitid(os.P_PID, worker, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker, signal.SIGKILL)
    status = None
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == worker:
            status = code


def _end_all(worker: int, status: int | None) -> int:
    """SIGKILL the worker (unless it has exited) and every process below us, until none
    is left; the worker's wait status. Its process group went with it (``_reap``): most
    often every child ends at once, and no search of /proc is needed."""
    while True:
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker, signal.SIGKILL)
        while True:  # reap every child that has ended; done when none is left
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                assert status is not None
                return status
            if pid == 0:
                break
            if pid == worker:
                status = code
        if signal.sigtimedwait({signal.SIGCHLD}, 0.01) is None:
            # None ended for 10 ms: find the rest (out of the group) and end them. A killed
            # child's own children are re-parented to us as it dies: a later pass finds them.
            for pid in _children():  # ours and not reaped, so the PID is still theirs
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    """PIDs whose parent is this process, from /proc (``task/*/children`` is not in
    every kernel)."""
    me = os.getpid()
    found = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                    fields = stat.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 1 and int(fields[1]) == me:
                found.append(int(name))
    return found


def _main() -> NoReturn:
    """The shepherd after ``_shed_image``: argv WORKER PARENT_PID NOTICE NOTICE_FROM (-1:
    none)."""
    worker, parent_pid, notice, notice_from = (int(arg) for arg in sys.argv[1:5])
    _prctl(PR_SET_NAME, NAME.encode())
    _watch(worker, parent_pid, _notice_of(None if notice < 0 else notice,
                                          None if notice_from < 0 else notice_from))


def _exit_as(status: int) -> NoReturn:
    """Exit with the worker's code, or die by the signal that killed it."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(
            resource.RLIMIT_CORE)[1]))  # the worker's core dump is the one that matters
        with contextlib.suppress(OSError, ValueError):  # SIGKILL keeps its action
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _main()
