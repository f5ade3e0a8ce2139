"""A detached job's agent: a process of its own (a fresh interpreter in a session of its
own, never a fork of the kernel) that runs the job as a kernel's agent thread would, so the
kernel's death, restart or interrupt does not touch it. Kernels of the same user attach to
it through a unix socket in their private runtime folder (``detached_folder``).

The kernel that starts it writes the job (``Order``) into its stdin (a standby first gets
``Prewarm``, and starts its warm pool while it waits for a job), a pipe nobody else can
reach, and reads one line back once the socket listens. The agent keeps the job's events
(each rank's output as its last lines; all of it is in the run's logs), so a kernel that
attaches later sees the job's story, then follows it live. Once the job has ended it keeps
the result until a kernel takes it or ``--keep`` seconds pass, then removes its socket and
connection file and exits. SIGTERM stops the job first; if the agent is killed outright
its workers die with it (their shepherds' parent-death signal)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ...checks import SpecError
from ...spec import JobSpec
from ...wire import attach_messages as attach
from ...wire.events import Committed, Event, Output
from ...wire.metrics import Logged
from ...wire.payload import Payload
from ..machines.hub import HubError, Link, challenge, new_token
from ..node.environment import inherited_env
from ..node.pool import PoolError, shutdown_pool, warm_pool
from ..status import JobStatus
from . import detached_folder
from .handle import next_batch
from .job import Job

SEND_TIMEOUT = 30  # seconds a send to an attached kernel may block before it is let go
TAIL_LINES = 1000  # output lines per rank and stream a kernel gets when it attaches
COMMITS = 1000  # commits it gets, the newest (a long training commits every few steps)
LOGGED = 200_000  # logged points it gets at most, the newest (about 20 MB in the agent)


@dataclass(frozen=True)
class Prewarm:
    """A standby agent's warm pool: made for a job of this size, folder and path, from a
    kernel whose environment had this digest (the standby took it when it started)."""

    nproc: int
    cwd: str
    sys_path: tuple[str, ...]
    preload: tuple[str, ...]
    environ: str
    pool: bool  # False (--no-pool): nothing to warm


@dataclass(frozen=True)
class Order:
    """What the starting kernel hands its detached agent."""

    spec: JobSpec
    payload: Payload
    run_id: str
    title: str


def status_fields(status: JobStatus) -> dict[str, Any]:
    """The board's fields as plain data (its mappings are read-only proxies: not pickled)."""
    found = {}
    for field in fields(status):
        value = getattr(status, field.name)
        found[field.name] = dict(value) if hasattr(value, "items") else value
    return found


class History:
    """The job's events for a kernel that attaches: the job's story (its states, rounds,
    failures, the newest ``COMMITS`` commits), each rank's last ``TAIL_LINES`` lines of
    output per stream, and the newest ``LOGGED`` points of logged scalars (a training that
    commits and logs every step for days would otherwise grow the agent without end;
    ``JobResult.metrics`` keeps every point)."""

    def __init__(self) -> None:
        self._events: list[tuple[int, Event]] = []
        self._commits: deque[tuple[int, Committed]] = deque(maxlen=COMMITS)
        self._logged: deque[tuple[int, Logged]] = deque()
        self._points = 0
        self._output: dict[tuple[int, str], deque[tuple[int, Output]]] = {}
        self._lines: dict[tuple[int, str], int] = {}
        self._count = 0
        self.left_out = 0

    def add(self, event: Event) -> None:
        self._count += 1
        if isinstance(event, Logged):
            self._logged.append((self._count, event))
            self._points += len(event.points)
            while len(self._logged) > 1 and self._points > LOGGED:
                self._points -= len(self._logged.popleft()[1].points)
            return
        if isinstance(event, Committed):  # one per commit: the newest tell the story
            self._commits.append((self._count, event))
            return
        if not isinstance(event, Output):
            self._events.append((self._count, event))
            return
        key = (event.rank, event.stream)
        kept = self._output.setdefault(key, deque())
        kept.append((self._count, event))
        self._lines[key] = self._lines.get(key, 0) + len(event.lines)
        while len(kept) > 1 and self._lines[key] - len(kept[0][1].lines) >= TAIL_LINES:
            _, dropped = kept.popleft()
            self._lines[key] -= len(dropped.lines)
            self.left_out += len(dropped.lines)

    def events(self) -> tuple[Event, ...]:
        merged: list[tuple[int, Event]] = [
            *self._events, *self._commits, *self._logged,
            *(item for kept in self._output.values() for item in kept)]
        return tuple(event for _, event in sorted(merged, key=lambda item: item[0]))


class DetachedAgent:
    """Runs ``job`` and serves the kernels that attach to it."""

    def __init__(self, order: Order, folder: Path) -> None:
        self.order = order
        self.folder = folder
        self.token = new_token()
        self.job = Job(order.spec, order.payload, order.run_id)
        self.history = History()
        self.ended: attach.Ended | None = None
        self.taken = threading.Event()
        self.stopping: str | None = None  # a signal's name: the job stops, the agent goes
        self._lock = threading.Lock()  # history and the attached kernels change together
        self._kernels: list[Link] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socket = folder / detached_folder.socket_name(order.run_id)
        with contextlib.suppress(FileNotFoundError):
            self.socket.unlink()  # our own folder: a socket left by a killed agent
        detached_folder.at_socket(self._server, folder, self.socket.name, bind=True)
        self.socket.chmod(0o600)
        self._server.listen(8)

    def publish(self) -> None:
        """The connection file: from now on kernels of the user can find and attach."""
        detached_folder.Connection(
            self.order.run_id, os.getpid(), str(self.folder), self.token, time.time(),
            self.order.title).write(self.folder)

    def serve(self) -> int:
        """Until the result is taken or kept long enough; the exit status."""
        threading.Thread(target=self._accept, name="elastic-attach", daemon=True).start()
        self.job.start()
        try:
            self._pump()
            shutdown_pool()  # no group starts again: the warm pool goes, the result waits
            deadline = time.monotonic() + self.order.spec.keep
            while not self.taken.wait(0.2) and self.stopping is None \
                    and time.monotonic() < deadline:
                pass
        finally:
            self._close()
        return 0

    def _pump(self) -> None:
        """The job's events and status to every attached kernel, until it ends."""
        status, stopped = self.job.status_snapshot, False
        while True:
            batch = next_batch(self.job.events, wait=True)
            if self.stopping is not None and not stopped:  # a signal's handler said so
                self.job.stop(f"the detached agent got {self.stopping}")
                stopped = True
            now = self.job.status_snapshot
            with self._lock:
                for event in batch:
                    self.history.add(event)
                if batch:
                    self._broadcast(attach.NewEvents(tuple(batch)))
                if now is not status:
                    old, new = status_fields(status), status_fields(now)
                    self._broadcast(attach.StatusChanged(
                        {k: v for k, v in new.items() if old[k] != v}))
                    status = now
                if self.job.done and self.job.events.empty():
                    error = self.job.error
                    self.ended = attach.Ended(self.job.result, None if error is None
                                              else f"{type(error).__name__}: {error}")
                    self._broadcast(self.ended)
                    return

    def _broadcast(self, message: Any) -> None:
        kept = []
        for kernel in self._kernels:
            if kernel.send(message):
                kept.append(kernel)
            else:  # gone, or it stopped reading (mid-frame, maybe): its reader closes it
                kernel.shutdown()
        self._kernels = kept

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._attach, args=(sock,), daemon=True,
                             name="elastic-attached").start()

    def _attach(self, sock: socket.socket) -> None:
        uid = detached_folder.peer_uid(sock)
        if uid != os.getuid():
            print(f"refused an attach from user id {uid}: this job is user id "
                  f"{os.getuid()}'s", file=sys.stderr, flush=True)
            sock.close()
            return
        # A kernel that stops reading (frozen, or its machine asleep) is let go rather
        # than blocking the job's events for every other kernel.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT, 0))
        try:
            kernel = Link(sock, challenge(sock, self.token, "a kernel"), "a kernel")
        except (HubError, OSError) as exc:
            print(f"refused an attach: {exc}", file=sys.stderr, flush=True)
            sock.close()
            return
        with self._lock:
            welcome = attach.Welcome(self.order.run_id, self.order.spec,
                                     self.history.events(),
                                     status_fields(self.job.status_snapshot),
                                     self.history.left_out)
            if kernel.send(welcome) and (self.ended is None or kernel.send(self.ended)):
                self._kernels.append(kernel)
        self._serve(kernel)

    def _serve(self, kernel: Link) -> None:
        while True:
            try:
                message = kernel.recv()
            except Exception:  # gone, or a frame that failed its signature
                with self._lock:  # no broadcast writes to it once its descriptor is closed
                    self._kernels = [k for k in self._kernels if k is not kernel]
                kernel.close()
                return
            match message:
                case attach.Command(command):
                    self.job._inbox.put(command)
                case attach.StacksAsked(request):
                    # answered from a thread of its own: the future completes on the
                    # job's own loop, which a slow kernel must not hold up
                    threading.Thread(target=_answer_stacks, daemon=True,
                                     args=(kernel, request, self.job.request_stacks()),
                                     name="elastic-attached-stacks").start()
                case attach.ScaleNodes(nnodes):
                    try:
                        self.job.scale_nodes(nnodes)
                    except (ValueError, SpecError) as exc:  # it ended; or out of bounds
                        print(f"scale --nodes {nnodes}: {exc}", file=sys.stderr, flush=True)
                case attach.ResultTaken():
                    self.taken.set()

    def _close(self) -> None:
        ended_well = self.ended is not None and self.ended.error is None
        detached_folder.remove(self.folder, self.order.run_id, log=ended_well)
        with contextlib.suppress(OSError):  # wakes the accepting thread; close() would not
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        with self._lock:
            for kernel in self._kernels:
                kernel.shutdown()  # each reader closes its own
            self._kernels = []


def _answer_stacks(kernel: Link, request: int, stacks: Future[dict[int, str]]) -> None:
    try:
        found = stacks.result(timeout=60)
    except FutureTimeout:  # the job's loop is tearing a group down: none this time
        found = {}
    kernel.send(attach.StacksAnswer(request, found))


def _warm(wanted: Prewarm) -> None:
    """A standby's warm pool, as a kernel's is after a job of this size: the zygote, and
    a spare rank forked ahead for each of the job's workers."""
    if not wanted.pool:
        return
    with contextlib.suppress(PoolError):
        zygote = warm_pool().zygote_for(inherited_env(wanted.nproc), wanted.cwd,
                                        wanted.sys_path, wanted.preload)
        zygote.keep_spares(wanted.nproc)


def _order(folder: Path, log: str) -> Order | None:
    """The job, from our own kernel's pipe (nobody else writes it); a standby warms its
    pool first. None when the kernel closed the pipe instead (it is gone, or gave us up)."""
    try:
        first = pickle.load(sys.stdin.buffer)
        if isinstance(first, Prewarm):
            threading.Thread(target=_warm, args=(first,), daemon=True,
                             name="elastic-standby-warm").start()
            first = pickle.load(sys.stdin.buffer)
    except (EOFError, pickle.UnpicklingError):  # the kernel went (or gave us up)
        with contextlib.suppress(FileNotFoundError):
            (folder / log).unlink()
        # No job ran: nothing to release but the warm pool, whose zygote ends with us. Its
        # orderly shutdown could wait for ever on a zygote still starting (seen: standbys
        # left behind by finished benchmark scripts, blocked in it).
        os._exit(0)
    assert isinstance(first, Order)
    os.rename(folder / log, folder / f"{first.run_id}.log")  # where its kernel looks
    return first


def main() -> int:
    """``elastic_magic.agent.handles.detached_agent LOG``: started by ``detached_launch``
    (LOG: its log's name in the runtime folder, its stderr)."""
    folder = detached_folder.runtime_folder()
    order = _order(folder, sys.argv[1])
    if order is None:
        return 0
    agent = DetachedAgent(order, folder)

    def stop(signum: int, _: Any) -> None:  # no lock taken here: the pump acts on it
        agent.stopping = signal.Signals(signum).name

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    agent.publish()
    with contextlib.suppress(OSError):  # a kernel interrupted meanwhile: the job runs on
        print(agent.socket, flush=True)  # the kernel's go-ahead
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    return agent.serve()
