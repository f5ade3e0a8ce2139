"""Rounds without idle waits: what torch's rendezvous handler sleeps that a job here does
not need. Imported by ``rendezvous.py``, before any handler runs; the hooks into torch are
``torch_internals.pace_rendezvous_polls``.

- torch sleeps a random 0-0.3 s before a run id's first round (``_delay`` with a range), to
  spread the first requests of many nodes. Every job here is a new run id on a few
  machines, so that sleep was about 150 ms of every launch (a third of a warm one).
- While an operation (join, leave) waits for the others, torch polls the shared state once
  a second, so each round on several machines lost up to a second after the last machine
  arrived. Here the poll starts at 10 ms and backs off to a quarter second while nothing
  changes; any change in the state (a machine joined, the round completed) starts it over.
  A job waiting long for machines reads the store four times a second, not once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ... import torch_internals

FIRST_POLL = 0.01
LONGEST_POLL = 0.25

_polling = threading.local()  # the operation this thread runs: its executor and next poll


def _signature(state: Any) -> tuple[Any, ...]:
    """What a waiting node acts on; a poll that sees it change starts the backoff over."""
    return (state.round, state.complete, state.closed, state.deadline,
            tuple(sorted(map(str, state.participants))), tuple(sorted(map(str, state.wait_list))))


def _delay(seconds: float | tuple[float, float]) -> None:
    if isinstance(seconds, tuple):
        return  # the first round's jitter: not needed here
    executor = getattr(_polling, "executor", None)
    if executor is None:
        _torch_delay(seconds)
        return
    seen = _signature(torch_internals.operation_state(executor))
    if seen != _polling.seen:
        _polling.seen, _polling.interval = seen, FIRST_POLL
    time.sleep(min(_polling.interval, seconds))
    _polling.interval = min(_polling.interval * 2, LONGEST_POLL)


def _run(self: Any, *args: Any, **kwargs: Any) -> None:
    _polling.executor, _polling.seen, _polling.interval = self, None, FIRST_POLL
    try:
        _torch_run(self, *args, **kwargs)
    finally:
        _polling.executor = None


# torch's own two: outside an operation, torch's pace; an operation runs as torch runs it.
_torch_delay, _torch_run = torch_internals.pace_rendezvous_polls(_delay, _run)
