"""A detached job's agent: a process of its own (a fresh interpreter in a session of its
own, never a fork of the kernel) that runs the job as a kernel's agent thread would, so the
kernel's death, restart or interrupt does not touch it. Kernels of the same user attach to
it through a unix socket in their private runtime folder (``detached_folder``).

The kernel that starts it writes the job (``Order``) into its stdin, a pipe nobody else can
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
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ...spec import JobSpec
from ...wire import attach_messages as attach
from ...wire.events import Event, Output
from ...wire.payload import Payload
from ...wire.protocol import Channel
from ..machines.hub import HubError, challenge, new_token
from ..status import JobStatus
from . import detached_folder
from .handle import next_batch
from .job import Job

TAIL_LINES = 1000  # output lines per rank and stream a kernel gets when it attaches


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


class SignedSocket:
    """One attached kernel: signed frames both ways, sends serialised."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self.sock = sock
        self._channel = Channel(sock.fileno(), key)
        self._lock = threading.Lock()

    def send(self, message: Any) -> bool:
        with self._lock:
            try:
                self._channel.send(message)
                return True
            except OSError:
                return False

    def recv(self) -> Any:
        return self._channel.recv()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self.sock.close()


class History:
    """The job's events for a kernel that attaches: all but output, and each rank's last
    ``TAIL_LINES`` lines of output per stream."""

    def __init__(self) -> None:
        self._events: list[tuple[int, Event]] = []
        self._output: dict[tuple[int, str], deque[tuple[int, Output]]] = {}
        self._lines: dict[tuple[int, str], int] = {}
        self._count = 0
        self.left_out = 0

    def add(self, event: Event) -> None:
        self._count += 1
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
            *self._events, *(item for kept in self._output.values() for item in kept)]
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
        self._lock = threading.Lock()  # history and the attached kernels change together
        self._kernels: list[SignedSocket] = []
        self._requests: dict[tuple[int, int], Any] = {}
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
            self.taken.wait(self.order.spec.keep)
        finally:
            self._close()
        return 0

    def _pump(self) -> None:
        """The job's events and status to every attached kernel, until it ends."""
        status = self.job.status_snapshot
        while True:
            batch = next_batch(self.job.events, wait=True)
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
        self._kernels = [kernel for kernel in self._kernels if kernel.send(message)]

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
        try:
            kernel = SignedSocket(sock, challenge(sock, self.token, "a kernel"))
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

    def _serve(self, kernel: SignedSocket) -> None:
        while True:
            try:
                message = kernel.recv()
            except Exception:  # gone, or a frame that failed its signature
                kernel.close()
                return
            match message:
                case attach.Command(command):
                    self.job._inbox.put(command)
                case attach.StacksAsked(request):
                    self.job.request_stacks().add_done_callback(
                        _answering(kernel, request))
                case attach.ResultTaken():
                    self.taken.set()

    def _close(self) -> None:
        detached_folder.remove(self.folder, self.order.run_id, log=True)
        self._server.close()
        with self._lock:
            for kernel in self._kernels:
                kernel.close()
            self._kernels = []


def _answering(kernel: SignedSocket, request: int) -> Callable[[Future[dict[int, str]]], None]:
    def answer(done: Future[dict[int, str]]) -> None:
        kernel.send(attach.StacksAnswer(request, done.result()))

    return answer


def main() -> int:
    """``elastic_magic.agent.handles.detached_agent``: started by ``attached.start``."""
    order = pickle.load(sys.stdin.buffer)  # our own kernel's pipe: nobody else writes it
    assert isinstance(order, Order)
    agent = DetachedAgent(order, detached_folder.runtime_folder())

    def stop(signum: int, _: Any) -> None:
        agent.job.stop(f"the detached agent got {signal.Signals(signum).name}")
        agent.taken.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    agent.publish()
    print(agent.socket, flush=True)  # the kernel's go-ahead
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    return agent.serve()
