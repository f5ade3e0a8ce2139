"""The worker's line to its agent: reports, and requests that wait for a reply.

One instance per worker process, installed by the entrypoint. ``State`` uses it to fetch
and commit snapshots; outside a job there is none (``current()`` returns None).
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

from elastic_magic.protocol import Channel

_current: AgentClient | None = None


class AgentClient:
    def __init__(self, report: Channel) -> None:
        self._report = report
        self._lock = threading.Lock()  # user code may commit from any thread
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[Any]] = {}

    def send(self, kind: str, body: Any) -> None:
        with self._lock:
            self._report.send((kind, body))

    def request(self, kind: str, body: dict[str, Any]) -> Any:
        """Send a request and block until the agent answers it."""
        request_id = next(self._ids)
        answer: queue.Queue[Any] = queue.Queue(maxsize=1)
        self._replies[request_id] = answer
        try:
            self.send(kind, {**body, "request_id": request_id})
            return answer.get()
        finally:
            del self._replies[request_id]

    def deliver(self, body: dict[str, Any]) -> None:
        """Called by the control listener for each ("reply", body) message."""
        answer = self._replies.get(body["request_id"])
        if answer is not None:
            answer.put(body["value"])


def install(client: AgentClient) -> None:
    global _current
    _current = client


def current() -> AgentClient | None:
    return _current
