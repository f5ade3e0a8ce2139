"""The zygote: a fresh interpreter that has imported torch and the worker runtime, and
forks a rank's shepherd (which forks the worker, as ``python -m elastic_magic.worker``
would) on the agent's request, so a worker starts in milliseconds instead of importing
torch again. It is never a fork of the kernel, and never initialises CUDA, so a kernel
that has touched CUDA still launches, and forked workers may use it.

argv: SOCKET_FD KERNEL_PID. The socket (SOCK_SEQPACKET, inherited at spawn: nobody else
holds it) carries JSON, never pickles. First the pool sends what to preload beyond the
base imports (``{"op": "preload", "modules": [[name, file or null], ...], "path": [...],
"more": bool}``, in parts); each module is imported, if trusted (``imports.py``), then
checked (``import_checks``: CUDA, threads, files left open, per-rank variables read):
one that broke a rule cannot be undone, so the zygote
answers ``{"tainted": name, "why": ...}`` and exits (the pool rebuilds without it); one
left out answers ``{"left_out": name, "why": ...}``; ``{"importing": name}`` comes before
each (the pool leaves out one the zygote dies or hangs on); then ``{"implied": [name,
...]}``, in parts, for those an earlier module imported, and ``{"ready": pid}``. Then
requests:

- ``{"op": "fork", "env": {...}, "cwd": "...", "spares": n}`` with the worker's
  descriptors attached (control pipe, report pipe, stdout, stderr): answered
  ``{"pid": shepherd}`` (``{"error": why}`` when it cannot fork); a spare forked ahead
  takes the job if there is one (``spares.py``), and ``n`` spares are kept from then on
  (the preload list's last part says how many at first);
- ``{"op": "spares", "spares": n}``: keep ``n`` (the idle ones beyond end now; the pool
  sends 0 to a zygote it retires): answered ``{"spares": n}``;
- ``{"op": "reap", "pid": P}``: answered ``{"status": wait status}``. A shepherd that has
  exited stays a zombie until then, so its PID stays the agent's to signal.

EOF on the socket, or the kernel's death (PR_SET_PDEATHSIG), ends the zygote (its idle
spares ended and reaped first, on EOF); its shepherds then end their ranks (their own
PR_SET_PDEATHSIG). Idle, it blocks in recvmsg.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import select
import signal
import socket
import sys
import weakref
from typing import Any, NoReturn

from elastic_magic.worker import forked
from elastic_magic.worker.spares import Spares

PR_SET_PDEATHSIG = 1
NAME = "em-zygote"  # its name in ps and top


def _prctl(option: int, value: int | bytes) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def warm_up() -> None:
    """Import what every worker imports, never touching CUDA (what cells need beyond it
    comes as the preload list: ``preload``)."""
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed
    import torch.nn.parallel  # DistributedDataParallel
    import torch.optim

    import elastic_magic.training.state
    import elastic_magic.worker.__main__
    import elastic_magic.worker.default_group  # noqa: F401

    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401  (torch's object collectives need it)
    assert not torch.cuda.is_initialized(), "the zygote must never initialise CUDA"


def preload(sock: socket.socket) -> int:
    """Import the preload list the pool sends, checking after each package and module
    that the zygote is still safe to fork (``import_checks``). A module that broke that
    is reported and the zygote exits (an import cannot be undone). The spares to keep,
    as the list's last part says."""
    import torch

    from elastic_magic.worker import import_checks, imports

    entries: list[list[Any]] = []
    while True:
        request = json.loads(sock.recv(forked.MAX_MESSAGE) or b"{}")
        if request.get("op") != "preload":
            os._exit(1)  # the pool speaks first, or it is gone
        entries += request["modules"]
        sys.path.extend(p for p in request["path"] if p not in sys.path)
        if not request["more"]:
            break
    roots, cwd = imports.trusted_roots(sys.path), os.getcwd()
    implied = []  # imported with an earlier module: the pool need not list them
    for name, origin in entries:
        if name in sys.modules:
            implied.append(name)
            continue
        _send(sock, {"importing": name})  # should it crash or hang, the pool knows why
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):  # each package apart: the one to blame
            prefix = ".".join(parts[:depth])
            if prefix in sys.modules:
                continue
            with import_checks.watched() as unsafe:
                why = imports.import_trusted(prefix, origin if prefix == name else None,
                                             roots, cwd)
            if unsafe:  # an import cannot be undone: this zygote is done
                _send(sock, {"tainted": prefix, "why": "; ".join(unsafe)})
                os._exit(0)
            if why is not None:
                _send(sock, {"left_out": prefix, "why": why})
                break
    for i in range(0, len(implied), 100):  # in parts: each answer must stay short
        _send(sock, {"implied": implied[i:i + 100]})
    assert not torch.cuda.is_initialized(), "the zygote must never initialise CUDA"
    _no_operator_cleanup_at_exit()
    imports.BASELINE = frozenset(sys.modules)  # what a forked worker has without importing
    # What is imported now is kept for good: the collector of a forked worker then never
    # walks (and so never copies) the pages it shares with us.
    gc.collect()
    gc.freeze()
    return int(request.get("spares", 0))


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message).encode())


def _no_operator_cleanup_at_exit() -> None:
    """torch.library unregisters each of its ~130 operator libraries when the interpreter
    exits (a weakref finalizer each): 40-100 ms of every worker's exit, for a process that
    is ending anyway. A worker's own finalizers, and libraries it makes, still run."""
    from elastic_magic import torch_internals

    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer in list(registry):
        held = finalizer.peek()
        if held is not None and torch_internals.is_library_cleanup(held[1]):
            finalizer.atexit = False


def main() -> None:
    sock_fd, kernel_pid = int(sys.argv[1]), int(sys.argv[2])
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != kernel_pid:  # the kernel went before prctl took effect
        os._exit(1)
    # Spawned with SIGINT and SIGTERM blocked (as workers are): kept so, it ends only by
    # EOF or SIGKILL, and the shepherds it forks start as spawned ones do.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    forked.set_name(NAME.encode())
    sock = socket.socket(fileno=sock_fd)
    warm_up()
    wanted = preload(sock)
    _send(sock, {"ready": os.getpid()})
    spares = Spares(sock)
    spares.want(wanted)
    while True:
        readable = select.select([sock, *spares.sockets], [], [], spares.refill_after())[0]
        spares.drop_dead([s for s in readable if s is not sock])
        if sock not in readable:
            if spares.short():
                spares.add()  # quiet for a while: not while the group it served starts
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, forked.MAX_MESSAGE, forked.WORKER_FDS)
        if not data:  # the kernel closed its end (or is gone)
            spares.end_all()
            os._exit(0)
        request = json.loads(data)
        reply: dict[str, Any]
        if request["op"] == "fork":
            spares.want(request.get("spares", 0))
            try:
                reply = {"pid": spares.hand_out(fds, request)
                         or _fork_worker(spares, fds, request)}
            except OSError as exc:  # processes at their limit: the pool says why
                reply = {"error": f"the zygote could not fork: {exc}"}
        elif request["op"] == "spares":  # a retired zygote keeps none
            spares.want(request["spares"])
            reply = {"spares": spares.wanted}
        elif request["op"] == "reap":
            reply = {"status": os.waitpid(int(request["pid"]), 0)[1]}
        else:
            reply = {"error": f"unknown request {request['op']!r}"}
        for fd in fds:  # the worker's ends are the worker's: EOF must reach the agent
            os.close(fd)
        sock.sendall(json.dumps(reply).encode())


def _fork_worker(spares: Spares, fds: list[int], request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    spares.close_in_child()
    forked.crash_on_error(lambda: _become_worker(fds, request))


def _become_worker(fds: list[int], request: dict[str, Any]) -> NoReturn:
    """In the forked child: a fresh worker's set-up (``forked.py``), then the worker's own
    entry point."""
    control, report, out, err, notice = fds
    forked.detach({control, report, notice}, out, err, forked.WORKER_NAME)
    forked.take_job(request["env"], request["cwd"])
    forked.reseed()
    from elastic_magic.worker.__main__ import serve

    forked.run_rank(lambda: serve(control, report, notice, os.getppid()))


if __name__ == "__main__":
    main()
