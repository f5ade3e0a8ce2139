"""Our end of one zygote (``worker/zygote.py``): the process, its socket, and the ranks'
shepherds it forks (``PooledProcess``). ``pool.py`` decides which zygote serves a job.

To the agent, a pooled rank is a ``PooledProcess``: like ``subprocess.Popen``, it has a
``pid`` to signal, ``poll()`` and ``returncode``. The zygote keeps an exited shepherd as a
zombie until we reap it through the zygote, so the PID is never another process's while
we may signal it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from ...worker import import_checks
from . import interpreter, preload
from .preload import Entry

_START_TIMEOUT = 120.0  # importing torch on a busy machine
_MAX_REPLY = 1 << 16  # the zygote's answers are short; a request may be longer


def zygote_env(env: dict[str, str]) -> dict[str, str]:
    """A worker's environment without what is particular to its round and job."""
    return {k: v for k, v in env.items() if not import_checks.is_per_round(k)}


class PoolError(RuntimeError):
    """The zygote could not start or stopped answering."""


class Tainted(PoolError):
    """A preloaded module initialised CUDA or started a thread: the zygote is unusable."""

    def __init__(self, module: str, why: str) -> None:
        super().__init__(f"{module} {why}")
        self.module, self.why = module, why


class Zygote:
    """One zygote process and our end of its socket. Thread-safe. Started by the
    constructor (which sends the preload list ``modules``); usable after ``wait_ready``."""

    def __init__(self, env: dict[str, str], cwd: str, key: str, sys_path: Iterable[str] = (),
                 modules: tuple[Entry, ...] = (), spares: int = 0) -> None:
        self.key = key
        self.spares = spares  # ranks it forks ahead (``worker/spares.py``): as last asked
        self.inputs = (env, cwd, list(sys_path))  # what it was made from: for a successor
        self.modules = modules
        self.left_out: dict[str, str] = {}  # module -> why, as the zygote reported
        self.implied: set[str] = set()  # listed, and imported with an earlier module
        self.pid = -1  # once ready
        self._cancelled = False
        self.retired = False
        self.live: set[int] = set()  # forked, not yet reaped
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._started = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._error: BaseException | None = None
        try:
            self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError as exc:  # out of descriptors
            raise PoolError(f"the worker pool did not start: {exc}") from exc
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
            preload.send_list(self._sock, modules, self.inputs[2], spares)
        except OSError as exc:
            self.close()
            raise PoolError(f"the worker pool did not start: {exc}") from exc

    def wait_ready(self) -> None:
        """Wait until it has imported everything; raises Tainted (a module it must not
        have imported, or one it crashed or hung on) or PoolError (a rebuild's thread
        ends on nothing else: the pool would wait for it forever). Either way it is then
        closed."""
        importing = None  # the module it said it imports now
        try:
            while True:
                reply = self._receive(_START_TIMEOUT)  # each module in time, not all
                if "importing" in reply:
                    importing = str(reply["importing"])
                elif "left_out" in reply:
                    self.left_out[str(reply["left_out"])] = str(reply["why"])
                elif "implied" in reply:
                    self.implied.update(str(name) for name in reply["implied"])
                elif "tainted" in reply:
                    raise Tainted(str(reply["tainted"]), str(reply["why"]))
                else:
                    self.pid = int(reply["ready"])
                    return
        except PoolError as exc:
            self.close()  # reaped, and its keeper thread ends
            if importing is None or self._cancelled or isinstance(exc, Tainted):
                raise
            raise Tainted(importing, f"stopped the pool while it imported it ({exc})") \
                from exc
        except (KeyError, ValueError) as exc:  # a reply it never sends: as if it failed
            self.close()
            raise PoolError(f"the worker pool answered out of protocol: {exc!r}") from exc

    def cancel(self) -> None:
        """End a zygote still importing (``wait_ready`` then raises PoolError)."""
        self._cancelled = True
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(OSError):  # not reaped before close(): still ours
                self._proc.kill()

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

    def fork(self, env: dict[str, str], cwd: str, fds: tuple[int, int, int, int, int],
             spares: int = 0) -> int:
        """Fork a rank's shepherd with these descriptors (control, report, stdout,
        stderr, notice), or give a spare the job; its PID. ``spares``: how many to keep ready
        from now on (the job's ranks on this machine). Our copies of ``fds`` stay ours
        to close."""
        with self._lock:
            self.spares = spares
            request = json.dumps({"op": "fork", "env": env, "cwd": cwd,
                                  "spares": spares}).encode()
            try:
                socket.send_fds(self._sock, [request], list(fds))
                reply = self._receive(_START_TIMEOUT)
            except (OSError, ValueError) as exc:
                raise PoolError(f"the worker pool stopped answering: {exc}") from exc
            if "pid" not in reply:  # it could not fork (processes at their limit, say)
                raise PoolError(str(reply.get("error", reply)))
            pid = int(reply["pid"])
            self.live.add(pid)
            return pid

    def keep_spares(self, count: int) -> None:
        """Keep ``count`` spare ranks from now on (``worker/spares.py``): the idle ones
        beyond end now."""
        with self._lock:
            with contextlib.suppress(OSError, PoolError):  # gone: so are its spares
                self._sock.sendall(json.dumps({"op": "spares", "spares": count}).encode())
                self._receive(10.0)
            self.spares = count

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
        try:  # a socket reset or closed under us (the pool stopping) is the pool's end too
            if not select.select([self._sock], [], [], timeout)[0]:
                raise PoolError("no answer from the worker pool")
            data = self._sock.recv(_MAX_REPLY)
        except (OSError, ValueError) as exc:
            raise PoolError(f"the worker pool has exited ({exc})") from exc
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
