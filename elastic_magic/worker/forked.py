"""What a process the zygote forks does to become a rank, and to end as one: what
``subprocess.Popen`` and a fresh interpreter would have given it (its own session, stdio,
no other descriptors, the job's environment and cwd, its own random seeds), and an exit
as an interpreter's. Both a rank forked on request (``zygote.py``) and a spare forked
ahead (``spares.py``) go through here."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from . import rank_answers

PR_SET_NAME = 15
WORKER_FDS = 5  # what a rank is handed: control, report, stdout, stderr, notice pipes
MAX_MESSAGE = 1 << 20  # a request, or a spare's job: the environment is the bulk
WORKER_NAME = os.path.basename(sys.executable)[:15].encode()  # as a spawned worker's


def set_name(name: bytes) -> None:
    """The process's name in ps and top (its command line stays the zygote's)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name, 0, 0, 0)


def detach(keep: set[int], stdout: int | None, stderr: int | None, name: bytes) -> None:
    """Its own session (the kernel's Ctrl-C reaches workers only through the agent), its
    name, stdin from /dev/null, ``stdout`` and ``stderr`` (/dev/null if None), and no
    descriptor but those and ``keep``."""
    os.setsid()
    set_name(name)
    null = os.open(os.devnull, os.O_RDWR)
    for source, target in ((null, 0), (stdout, 1), (stderr, 2)):
        os.dup2(null if source is None else source, target)
    keep = {0, 1, 2, *keep}
    for entry in os.listdir("/proc/self/fd"):
        if int(entry) not in keep:
            with contextlib.suppress(OSError):  # the listing's own, already closed
                os.close(int(entry))


def take_job(env: dict[str, str], cwd: str) -> None:
    """Wholly the job's environment, as exec would give it, and its directory; what
    preloaded modules answered from a rank's variables, answered again."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    rank_answers.set_again()


def reseed() -> None:
    """What a fresh interpreter seeds from the OS and a fork would share: torch's default
    generator and numpy's global one (``random`` re-seeds itself after fork)."""
    import torch

    torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def run_rank(serve: Callable[[], None]) -> NoReturn:
    """Run the rank (``serve``) and end as an interpreter ends."""
    code = 0
    try:
        serve()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    exit_interpreter(code)


def exit_interpreter(code: int) -> NoReturn:
    """End as an interpreter ends (non-daemon threads joined, atexit run, files the cell
    left open flushed), without returning into the zygote's loop and without tearing
    down every module (what makes a fresh worker's exit slow)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        _flush_open_files()
        os._exit(code)


def _flush_open_files() -> None:
    """Flush every file object the worker made (``open(...)`` never closed), as an
    interpreter's teardown would. The zygote's own objects are frozen (gc.freeze), so this
    looks only at what the worker created."""
    for generation in range(3):
        for obj in gc.get_objects(generation):
            if isinstance(obj, io.IOBase):
                with contextlib.suppress(Exception):  # closed, a broken pipe, not writable
                    obj.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


def crash_on_error(become: Callable[[], NoReturn]) -> NoReturn:
    """In a forked child: never return into the zygote's loop, whatever happens."""
    try:
        become()
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
