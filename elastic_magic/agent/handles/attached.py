"""A detached job as a kernel sees it: the same handle as a job whose agent runs in the
kernel (``Job``: events, status, ``wait``, ``stop``, ``scale``, ``stacks``), fed from the
job's own agent process (``detached_agent``) over its private unix socket.

Ctrl-C in a kernel attached to a detached job detaches (the job runs on; ``%elastic attach``
finds it again); ``stop()`` ends it."""

from __future__ import annotations

import itertools
import queue
import socket
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ...result import JobResult
from ...wire import attach_messages as told
from ...wire.messages import StacksCommand
from ..machines.hub import Link, answer_challenge
from . import detached_folder
from .handle import AgentError, AgentThread
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
        link_lost: Whether the link to its agent failed before the agent told the job's end
            (the job may run on: ``attach`` follows it again).
    """

    def __init__(self, connection: detached_folder.Connection) -> None:
        run_id = connection.run_id
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            detached_folder.at_socket(sock, Path(connection.folder),
                                      detached_folder.socket_name(run_id), bind=False)
            key = answer_challenge(
                sock, connection.token, f"{run_id}: its agent refused this kernel's token",
                f"{run_id}: the agent could not prove its token")
            self._link = Link(sock, key, run_id)
            welcome = self._link.recv()
            if not isinstance(welcome, told.Welcome):
                raise DetachedError(f"{run_id}: its agent did not greet this kernel")
        except DetachedError:
            sock.close()
            raise
        except Exception as exc:  # refused, gone, or a frame that failed its signature
            sock.close()
            why = str(exc) or type(exc).__name__
            raise DetachedError(f"cannot attach to {run_id}: {why}") from None
        except BaseException:  # Ctrl-C while attaching: nothing is left open
            sock.close()
            raise
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
        self._stacks_lock = threading.Lock()  # the sender adds, the reader answers
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
                        with self._stacks_lock:
                            answer = self._stacks.pop(request, None)
                        if answer is not None:
                            answer.set_result(stacks)
                    case told.Ended(result, error):
                        self.result = result
                        if error is not None:
                            self.error = AgentError(error)
                        self._link.send(told.ResultTaken())
                        return
        except Exception as exc:  # the agent is gone (killed) or the link failed
            if not self.detached:
                self.link_lost = True
                self.error = AgentError(self._lost(str(exc) or "its socket closed"))
        finally:
            self._done.set()
            self._board.publish(done=True)
            self._inbox.put(None)  # type: ignore[arg-type]  # the sender's end: it closes

    def _lost(self, why: str) -> str:
        run_id = self.run_id
        deadline = time.monotonic() + 1.0  # a killed agent: dead in a moment (its link closed)
        while (running := detached_folder.alive(self.connection.pid, self.connection.started)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if running:
            return (f"the link to the detached agent of {run_id} failed ({why}); the job "
                    f"may run on: %elastic attach {run_id} follows it again")
        return (f"the detached agent of {run_id} is gone ({why}): its workers ended with "
                "it; with --checkpoint-dir the next job resumes from the last commit")

    def _send_commands(self) -> None:
        try:
            while (item := self._inbox.get()) is not None:
                if isinstance(item, StacksCommand):
                    with self._stacks_lock:
                        request = next(self._requests)
                        self._stacks[request] = item.answer
                    self._link.send(told.StacksAsked(request))
                else:
                    self._link.send(told.Command(item))  # type: ignore[arg-type]
        finally:
            self._link.close()  # only now: no thread reads or sends on it any more
            self._answer_late()
            self._answer_unserved(None)  # stacks asked for, never answered: none come

    def _answer_unserved(self, item: Any) -> None:
        super()._answer_unserved(item)
        with self._stacks_lock:
            waiting, self._stacks = list(self._stacks.values()), {}
        for answer in waiting:
            if not answer.done():
                answer.set_result({})

    def detach(self) -> None:
        """Stop following the job here; it runs on (``attach`` finds it again)."""
        if not self.done:
            self.detached = True
            self._link.shutdown()  # wakes the reader; the sender closes it after

    def _interrupted(self) -> None:
        self.detach()

    def stop(self, reason: str = "stopped") -> None:
        """Ask the detached agent to stop every worker; returns at once.

        Args:
            reason: Why, as the job's result and panel show it.

        Raises:
            DetachedError: This handle detached (attach again to stop it).
        """
        self._following("stop")
        super().stop(reason)

    def scale(self, nproc: int, immediate: bool = False, include: Iterable[int] = ()) -> None:
        """Resize to ``nproc`` workers (see ``Job.scale``).

        Args:
            nproc: The new number of workers on the job's machine.
            immediate: Restart the group at the new size now, from the last commit.
            include: Worker slots left out for failing again that may come back.

        Raises:
            SpecError: ``nproc`` is outside the job's --min-nproc/--max-nproc bounds.
            DetachedError: This handle detached (attach again to resize it).
        """
        self._following("scale")
        super().scale(nproc, immediate, include)

    def _following(self, what: str) -> None:
        if self.detached:
            raise DetachedError(f"{what}: this kernel detached from {self.run_id}; "
                                f"%elastic attach {self.run_id} follows it again")

    def _ended_with(self) -> JobResult:
        if self.result is None:  # detached by another thread: the job runs on
            raise DetachedError(f"this kernel detached from {self.run_id}, which runs on: "
                                f"%elastic attach {self.run_id} follows it again")
        return self.result

    def _ask_for_machines(self, nnodes: int) -> None:
        if self.done:
            raise ValueError(f"{self.run_id} has already ended.")
        self._link.send(told.ScaleNodes(nnodes))

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
