"""The worker's line to its agent: reports, and requests that wait for a reply.

One instance per worker process, installed by the entrypoint. ``State`` uses it to fetch
and commit snapshots; outside a job there is none (``current()`` returns None).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from elastic_magic.wire.messages import Reply, StateRequest, WorkerMessage
from elastic_magic.wire.protocol import Channel

_current: AgentClient | None = None


class ResizeExit(BaseException):
    """Raised in every rank by a commit that applies a pending resize. The worker leaves
    cleanly and the agent starts the new group from this commit. A BaseException, so user
    code's ``except Exception`` does not swallow it."""

    def __init__(self, step: Any) -> None:
        super().__init__(f"resizing after the commit of step {step}")
        self.step = step


class AgentClient:
    """A worker's report pipe to its agent, shared by its threads: reports, requests matched
    to their replies, and the commit being sent behind the training."""

    def __init__(self, report: Channel) -> None:
        self._report = report
        self._lock = threading.Lock()  # user code may commit from any thread
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[Any]] = {}
        self._behind: threading.Thread | None = None  # a commit being sent
        self._behind_error: BaseException | None = None

    def behind(self, work: Callable[[], Any]) -> None:
        """Run ``work`` (sending a commit) on a thread while training goes on, once the
        one before has finished."""
        self.drain()

        def run() -> None:
            try:
                work()
            except BaseException as exc:  # raised by the next drain, in the training
                self._behind_error = exc

        self._behind = threading.Thread(target=run, name="elastic-commit", daemon=True)
        self._behind.start()

    def drain(self) -> None:
        """Wait for the commit being sent, if any; raises what went wrong with it."""
        if self._behind is not None:
            self._behind.join()
            self._behind = None
        error, self._behind_error = self._behind_error, None
        if error is not None:
            raise error

    def send(self, message: WorkerMessage) -> None:
        with self._lock:
            self._report.send(message)

    def request(self, make: Callable[[int], StateRequest]) -> Any:
        """Send the request ``make(request_id)`` and block until the agent answers it."""
        request_id = next(self._ids)
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._replies[request_id] = answer
        try:
            self.send(make(request_id))
            return answer.get()
        finally:
            del self._replies[request_id]

    def deliver(self, reply: Reply) -> None:
        """Called by the control listener for each Reply."""
        answer = self._replies.get(reply.request_id)
        if answer is not None:
            answer.put(reply.value)


def install(client: AgentClient) -> None:
    global _current
    _current = client


def current() -> AgentClient | None:
    return _current
