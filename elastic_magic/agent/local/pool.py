"""The warm pool (DESIGN decision 14): a zygote (``worker/zygote.py``) that imported torch
and the worker runtime forks each rank's shepherd, so workers start without importing
torch again. One zygote serves every job of this process while what workers would
inherit stays the same (environment, cwd, sys.path, installed packages: the
``fingerprint``); a change starts a new one, and the old one ends once its last worker is
reaped. It dies with this process (PR_SET_PDEATHSIG against the long-lived thread that
spawned it, and EOF on its socket).

To the agent, a pooled rank is a ``PooledProcess``: like ``subprocess.Popen``, it has a
``pid`` to signal, ``poll()`` and ``returncode``. The zygote keeps an exited shepherd as a
zombie until we reap it through the zygote, so the PID is never another process's while
we may signal it.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from . import interpreter

# Variables a round gives each rank (workers/torchrun_env): they differ between workers
# of one zygote, and nothing it imports reads them.
_PER_ROUND = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    # per worker or per machine, read only once the worker runs (torch reads the devices
    # at CUDA's first use, gloo and NCCL the interface when the group is made)
    "ELASTIC_MAGIC_SLOT", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
})
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_START_TIMEOUT = 120.0  # importing torch on a busy machine
_MAX_REPLY = 1 << 16


def _can_watch_others() -> bool:
    """pidfd_open (Linux 5.3): how we see a shepherd that is not our child exit."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


_SUPPORTED = sys.platform.startswith("linux") and _can_watch_others()


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment without what is particular to its round and job."""
    return {k: v for k, v in env.items()
            if k not in _PER_ROUND and not k.startswith("TORCHELASTIC_")}


def fingerprint(env: dict[str, str], cwd: str, sys_path: Iterable[str]) -> str:
    """What a zygote's imports depend on: the environment, cwd, sys.path, and the
    installed packages (the modification times of sys.path's package folders, which
    installing or removing a package changes, and of this package's own files). A user's
    own folders are not looked at: the zygote imports nothing from them."""
    paths = list(sys_path)
    stamps = {}
    packages = [p for p in paths if Path(p).name in ("site-packages", "dist-packages")]
    for entry in [*packages, *map(str, _PACKAGE_DIR.rglob("*.py"))]:
        with contextlib.suppress(OSError):
            stamps[entry] = os.stat(entry).st_mtime_ns
    text = json.dumps([sys.executable, sorted(zygote_env(env).items()), cwd, paths, stamps])
    return hashlib.sha256(text.encode()).hexdigest()


class PoolError(RuntimeError):
    """The zygote could not start or stopped answering."""


class Zygote:
    """One zygote process and our end of its socket. Thread-safe."""

    def __init__(self, env: dict[str, str], cwd: str, key: str) -> None:
        self.key = key
        self.retired = False
        self.live: set[int] = set()  # forked, not yet reaped
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._started = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits: this one lives as long
        # as the zygote should.
        self._keeper = threading.Thread(target=self._keep, args=(env, cwd, theirs),
                                        name="elastic-pool", daemon=True)
        self._keeper.start()
        self._started.wait()
        theirs.close()
        if self._error is not None:
            self._sock.close()
            raise PoolError(f"the worker pool did not start: {self._error}")
        try:
            self.pid = int(self._receive(_START_TIMEOUT)["ready"])
        except (PoolError, KeyError, ValueError):
            self.close()  # reaped, and its keeper thread ends
            raise

    def _keep(self, env: dict[str, str], cwd: str, theirs: socket.socket) -> None:
        # Blocked here, a Ctrl-C meant for the kernel cannot reach the zygote before it
        # has its own session; it keeps them blocked (see zygote.py).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            self._proc = subprocess.Popen(
                interpreter.command("elastic_magic.worker.zygote", str(theirs.fileno()),
                                    str(os.getpid())),
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, env=zygote_env(env), cwd=cwd,
                start_new_session=True,
            )
        except BaseException as exc:
            self._error = exc
        self._started.set()
        self._closed.wait()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self._closed.is_set()

    def fork(self, env: dict[str, str], cwd: str, fds: tuple[int, int, int, int]) -> int:
        """Fork a rank's shepherd with these descriptors (control, report, stdout,
        stderr); its PID. Our copies of ``fds`` stay ours to close."""
        with self._lock:
            request = json.dumps({"op": "fork", "env": env, "cwd": cwd}).encode()
            try:
                socket.send_fds(self._sock, [request], list(fds))
                pid = int(self._receive(_START_TIMEOUT)["pid"])
            except (OSError, KeyError, ValueError) as exc:
                raise PoolError(f"the worker pool stopped answering: {exc}") from exc
            self.live.add(pid)
            return pid

    def reap(self, pid: int) -> int | None:
        """Reap an exited shepherd; its wait status, or None when the zygote is gone
        (then so is the shepherd: it died with the zygote)."""
        with self._lock:
            try:
                self._sock.sendall(json.dumps({"op": "reap", "pid": pid}).encode())
                status: int | None = int(self._receive(10.0)["status"])
            except (OSError, KeyError, ValueError, PoolError):
                status = None
            self.live.discard(pid)
            idle = self.retired and not self.live
        if idle:
            self.close()
        return status

    def _receive(self, timeout: float) -> dict[str, Any]:
        if not select.select([self._sock], [], [], timeout)[0]:
            raise PoolError("no answer from the worker pool")
        data = self._sock.recv(_MAX_REPLY)
        if not data:
            raise PoolError("the worker pool has exited")
        reply: dict[str, Any] = json.loads(data)
        return reply

    def close(self) -> None:
        """End the zygote (EOF, then SIGKILL if need be) and reap it. Its live shepherds
        end their ranks as it goes."""
        if self._closed.is_set():
            return
        with self._lock:
            self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._closed.set()
        self._keeper.join(5.0)


class PooledProcess:
    """A rank's shepherd forked by a zygote, as the agent handles a Popen."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        self._finalizer = weakref.finalize(self, os.close, self._pidfd)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            status = self.zygote.reap(self.pid)
            self.returncode = -signal.SIGKILL if status is None \
                else os.waitstatus_to_exitcode(status)
            self._finalizer()
        return self.returncode


class WarmPool:
    """This process's zygotes: the current one, and retired ones until their last worker
    is reaped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: Zygote | None = None
        self._retired: list[Zygote] = []
        self._prewarming: threading.Thread | None = None
        self._failed: set[str] = set()  # fingerprints whose zygote could not start

    def zygote_for(self, env: dict[str, str], cwd: str, sys_path: Iterable[str]) -> Zygote:
        """The zygote whose workers inherit what these would: the current one, or a new
        one (the old one retires). Raises PoolError when it cannot start."""
        if not _SUPPORTED:
            raise PoolError("the warm pool needs Linux 5.3 or later (pidfd_open)")
        key = fingerprint(env, cwd, sys_path)
        with self._lock:
            current = self._current
            if current is not None and current.key == key and current.alive():
                return current
            if key in self._failed:  # it would fail again: fresh workers say why
                raise PoolError("the worker pool failed to start with these settings")
            if current is not None:
                self._retire(current)
                self._current = None
            try:
                self._current = Zygote(env, cwd, key)
            except PoolError:
                self._failed.add(key)
                raise
            return self._current

    def prewarm(self, env: dict[str, str], cwd: str, sys_path: list[str]) -> None:
        def start() -> None:
            with contextlib.suppress(PoolError):
                self.zygote_for(env, cwd, sys_path)

        self._prewarming = threading.Thread(target=start, name="elastic-pool-prewarm",
                                            daemon=True)
        self._prewarming.start()

    def _retire(self, zygote: Zygote) -> None:
        zygote.retired = True
        self._retired = [z for z in [*self._retired, zygote] if z.alive()]
        for old in [z for z in self._retired if not z.live]:
            old.close()
            self._retired.remove(old)

    @property
    def pids(self) -> list[int]:
        """The live zygotes' PIDs."""
        with self._lock:
            zygotes = [z for z in [self._current, *self._retired] if z is not None]
            return [z.pid for z in zygotes if z.alive()]

    def shutdown(self) -> None:
        """End every zygote (and so any rank still running from one)."""
        if self._prewarming is not None:  # it may be about to start one
            self._prewarming.join()
        with self._lock:
            zygotes = [z for z in [self._current, *self._retired] if z is not None]
            self._current, self._retired = None, []
        for zygote in zygotes:
            zygote.close()


_POOL: WarmPool | None = None
_POOL_LOCK = threading.Lock()


def warm_pool() -> WarmPool:
    """This process's pool, made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = WarmPool()
            atexit.register(_POOL.shutdown)
        return _POOL


def prewarm(env: dict[str, str], cwd: str, sys_path: Iterable[str]) -> None:
    """Start the zygote for workers that inherit this, on a thread (``%load_ext``: it
    imports torch while the kernel does); a job that needs another rebuilds it."""
    warm_pool().prewarm(env, cwd, list(sys_path))


def shutdown_pool() -> None:
    """End the pool if there is one (``%unload_ext``): no zygote is left."""
    with _POOL_LOCK:
        pool = _POOL
    if pool is not None:
        pool.shutdown()
