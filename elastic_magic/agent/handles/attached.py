"""A detached job as a kernel sees it: the same handle as a job whose agent runs in the
kernel (``Job``: events, status, ``wait``, ``stop``, ``scale``, ``stacks``), fed from the
job's own agent process (``detached_agent``) over its private unix socket.

Ctrl-C in a kernel attached to a detached job detaches (the job runs on; ``%elastic attach``
finds it again); ``stop()`` ends it."""

from __future__ import annotations

import itertools
import os
import pickle
import queue
import socket
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...spec import JobSpec
from ...wire import attach_messages as told
from ...wire.messages import StacksCommand
from ...wire.payload import Payload
from ..machines.hub import HubError, answer_challenge
from ..node import interpreter
from . import detached_folder
from .detached_agent import Order, SignedSocket
from .handle import AgentError, AgentThread, new_run_id
from .job import Job


class DetachedError(RuntimeError):
    """No detached job to attach to, or its agent could not be reached or started."""


class AttachedJob(Job):
    """Handle on a detached job: what ``Job`` offers, its agent in a process of its own.
    Made by ``attach`` (or ``%%elastic --detach``), which finds the job's connection.

    Args:
        connection: Where the job's agent listens, and its token.

    Raises:
        DetachedError: The agent cannot be reached, or refused this kernel.

    Attributes:
        lines_left_out: Output lines the agent did not keep for attaching kernels (they
            are in the run's logs, ``log_dir``).
        detached: Whether this kernel stopped following the job (Ctrl-C, ``detach()``)
            while it ran on.
    """

    def __init__(self, connection: detached_folder.Connection) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            detached_folder.at_socket(sock, Path(connection.folder),
                                      detached_folder.socket_name(connection.run_id),
                                      bind=False)
            key = answer_challenge(
                sock, connection.token, f"{connection.run_id}: its agent refused this "
                "kernel's token", f"{connection.run_id}: the agent could not prove its token")
            self._link = SignedSocket(sock, key)
            welcome = self._link.recv()
        except (OSError, HubError, EOFError) as exc:
            sock.close()
            raise DetachedError(f"cannot attach to {connection.run_id}: {exc}") from None
        if not isinstance(welcome, told.Welcome):
            self._link.close()
            raise DetachedError(f"{connection.run_id}: its agent did not greet this kernel")
        AgentThread.__init__(self, welcome.spec, welcome.run_id, hosts=False)
        self.events = queue.Queue()
        self._forward = None
        self._agent = None
        self.connection = connection
        self.lines_left_out = welcome.lines_left_out
        self.detached = False
        self._board.publish(**welcome.status)
        for event in welcome.history:
            self.events.put(event)
        self._requests = itertools.count()
        self._stacks: dict[int, Future[dict[int, str]]] = {}
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"elastic-attached-{self.run_id}")
        self._sender = threading.Thread(target=self._send_commands, daemon=True,
                                        name=f"elastic-attached-commands-{self.run_id}")
        self._thread.start()
        self._sender.start()

    def start(self) -> AttachedJob:
        """It runs already (in its own process): nothing to start.

        Returns:
            This handle, to chain ``.wait()``.
        """
        return self

    def _run(self) -> None:
        """Follow the agent until the job ends or this kernel detaches."""
        try:
            while True:
                message = self._link.recv()
                match message:
                    case told.NewEvents(events):
                        for event in events:
                            self.events.put(event)
                    case told.StatusChanged(changed):
                        self._board.publish(**changed)
                    case told.StacksAnswer(request, stacks):
                        if (answer := self._stacks.pop(request, None)) is not None:
                            answer.set_result(stacks)
                    case told.Ended(result, error):
                        self.result = result
                        if error is not None:
                            self.error = AgentError(error)
                        self._link.send(told.ResultTaken())
                        return
        except Exception as exc:  # the agent is gone (killed) or the link failed
            if not self.detached:
                why = str(exc) or "its socket closed"
                self.error = AgentError(
                    f"the detached agent of {self.run_id} is gone ({why}): its workers "
                    "ended with it; with --checkpoint-dir the next job resumes from the "
                    "last commit")
        finally:
            self._link.close()
            self._done.set()
            self._board.publish(done=True)
            self._inbox.put(None)  # type: ignore[arg-type]  # the command sender's end
            self._answer_late()

    def _send_commands(self) -> None:
        while (item := self._inbox.get()) is not None:
            if isinstance(item, StacksCommand):
                request = next(self._requests)
                self._stacks[request] = item.answer
                self._link.send(told.StacksAsked(request))
            else:
                self._link.send(told.Command(item))  # type: ignore[arg-type]

    def _answer_unserved(self, item: Any) -> None:
        super()._answer_unserved(item)
        for answer in self._stacks.values():
            if not answer.done():
                answer.set_result({})

    def detach(self) -> None:
        """Stop following the job here; it runs on (``attach`` finds it again)."""
        if not self.done:
            self.detached = True
            self._link.close()

    def _interrupted(self) -> None:
        self.detach()

    def end(self, reason: str) -> None:
        """Detach: a detached job outlives what ends the kernel's view of it (Ctrl-C, the
        cell's output failing, the extension unloaded); ``stop`` ends the job itself.

        Args:
            reason: Why the view ends (not told to the job, which runs on).
        """
        self.detach()
        self._done.wait()

    @property
    def interrupt_note(self) -> str:
        """What a Ctrl-C in ``wait`` did, as the notebook says it."""
        return (f"job {self.run_id} runs on, detached: %elastic attach {self.run_id} (or "
                f"elastic_magic.attach({self.run_id!r})) follows it again")


def start(spec: JobSpec, payload: Payload, *, title: str = "",
          run_id: str | None = None) -> AttachedJob:
    """Start ``payload`` as a detached job (its agent in a process of its own) and attach.
    Its result waits ``spec.keep`` seconds for a kernel once it has ended.

    Raises:
        DetachedError: The agent did not start (its log says why).
    """
    folder = detached_folder.runtime_folder()
    run_id = run_id or new_run_id()
    log = os.open(folder / f"{run_id}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        agent = subprocess.Popen(
            interpreter.command("elastic_magic.agent.handles.detached_agent"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=payload.cwd,
            env=interpreter.without_relative_pythonpath(dict(os.environ)),
            start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    # Reaped here while this kernel lives; by init once it is gone.
    threading.Thread(target=agent.wait, daemon=True, name=f"elastic-reap-{run_id}").start()
    assert agent.stdin is not None and agent.stdout is not None
    with agent.stdin:
        pickle.dump(Order(spec, payload, run_id, title), agent.stdin)
    ready = agent.stdout.readline()  # the socket listens and the connection file is there
    agent.stdout.close()
    if not ready:
        said = (folder / f"{run_id}.log").read_text(errors="replace")[-2000:]
        raise DetachedError(f"the detached agent of {run_id} did not start:\n{said}")
    connection = detached_folder.read(folder / f"{run_id}.json")
    if connection is None:
        raise DetachedError(f"{run_id}: the agent's connection file is not a private file")
    return AttachedJob(connection)


def detached_jobs() -> list[detached_folder.Connection]:
    """The user's detached jobs on this machine whose agents run.

    Returns:
        Each job's connection (``run_id``, ``title``, ``started``, the agent's ``pid``),
        oldest first.
    """
    return detached_folder.connections()


def attach(run_id: str | None = None) -> AttachedJob:
    """Attach this kernel to a detached job of the user's on this machine.

    Args:
        run_id: The job's run id (as ``%elastic attach`` lists them). None: the only one.

    Returns:
        Its handle: events so far, then live; ``wait()`` returns its JobResult.

    Raises:
        DetachedError: No such job, or several and no ``run_id``.
    """
    found = detached_jobs()
    if run_id is not None:
        found = [c for c in found if c.run_id == run_id]
    if len(found) != 1:
        listed = "; ".join(f"{c.run_id} ({c.title})" for c in detached_jobs()) or "none"
        raise DetachedError(
            f"{'no detached job ' + run_id if run_id else 'no single detached job'} of yours "
            f"runs on this machine. Detached jobs: {listed}.")
    return AttachedJob(found[0])
