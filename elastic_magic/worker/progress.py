"""What a worker tells its agent so that a hang can be named: whether its main thread moves
(sampled, a few reports a second at most) and, on request, every thread's stack; and, on
the same beat, what the cell logged with ``elastic_magic.log``."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

from elastic_magic.stacks import SERVICE_THREAD_PREFIX, ThreadStack, capture, position
from elastic_magic.training import log as metrics_log
from elastic_magic.wire.messages import Progress, Stacks
from elastic_magic.worker.client import AgentClient

SAMPLE_INTERVAL = 0.5  # seconds between looks at the main thread
REPORT_INTERVAL = 1.0  # at most one Progress report this often
# Set while a payload runs: an idle worker (a session's, between cells) samples nothing.
running = threading.Event()


def report_progress(client: AgentClient) -> threading.Thread:
    """Start the daemon thread that reports :class:`Progress` when the main thread's
    position (every frame's code and line) changed since the last look."""
    main_id = threading.main_thread().ident

    def sample() -> None:
        last: tuple[tuple[int, int], ...] = ()
        moved, reported = False, 0.0
        while True:
            running.wait()
            time.sleep(SAMPLE_INTERVAL)
            metrics_log.flush(client)  # what elastic_magic.log gathered meanwhile
            where = position(sys._current_frames().get(main_id or 0))
            moved = moved or where != last
            last = where
            now = time.monotonic()
            if moved and now - reported >= REPORT_INTERVAL:
                try:
                    client.send(Progress(time.time()))
                except OSError:  # the agent is gone; the lifeline ends us
                    return
                moved, reported = False, now

    thread = threading.Thread(target=sample, name=f"{SERVICE_THREAD_PREFIX}progress",
                              daemon=True)
    thread.start()
    return thread


def answer_stacks(client: AgentClient, request_id: int) -> None:
    """Send every thread's stack (from the control listener, while the main thread runs).
    Never raises: the listener is also the worker's lifeline."""
    threads: tuple[ThreadStack, ...]
    try:
        threads = capture()
    except Exception as exc:  # a stack we cannot read must not end the listener
        threads = (ThreadStack(f"<stacks unavailable: {exc!r}>", True, ()),)
    with contextlib.suppress(OSError):  # the agent is gone; the lifeline ends us
        client.send(Stacks(request_id, threads))
