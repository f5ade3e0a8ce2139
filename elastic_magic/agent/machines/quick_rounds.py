"""Rounds without idle waits: what torch's rendezvous handler sleeps that a job here does
not need. Imported by ``rendezvous.py``, before any handler runs; the hooks into torch are
in ``torch_internals/rendezvous_hooks.py``.

- torch sleeps a random 0-0.3 s before a run id's first round (``_delay`` with a range), to
  spread the first requests of many nodes. Every job here is a new run id on a few
  machines, so that sleep was about 150 ms of every launch (a third of a warm one).
- While an operation (join, leave) waits for the others, torch polls the shared state once
  a second, so each round on several machines lost up to a second after the last machine
  arrived. Here the poll starts at 10 ms and backs off to a quarter second while nothing
  changes; any change in the state (a machine joined, the round completed) starts it over.
  A job waiting long for machines reads the store four times a second, not once. Every
  poll reads the store (:func:`quicken`): torch's state holder otherwise answered from a
  copy up to a second old.
- A round with MIN machines but fewer than MAX waits out torch's last call (``--last-call``)
  for more. The head knows which machines are linked to it: a round it joins closes as
  soon as all of them are in (:func:`closing`); the last call is left for machines not yet
  linked or slow to join. While it runs, that machine polls every 50 ms.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ... import torch_internals

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

FIRST_POLL = 0.01
LONGEST_POLL = 0.25
LAST_CALL_POLL = 0.05  # a machine that may close the round: the next arrival may do it

# Given every participant's (address, agent pid): the round has everyone it waits for.
Ready = Callable[[set[tuple[str, int]]], bool]

# This thread's round: what may close it; the operation it runs, and the next poll.
_polling = threading.local()


def quicken(handler: DynamicRendezvousHandler) -> None:
    """Every poll of ``handler``'s operations reads the store (no second-old copy)."""
    torch_internals.read_state_at_every_poll(handler)


@contextlib.contextmanager
def closing(ready: Ready | None) -> Iterator[None]:
    """While this thread joins a round in the block: once the round has MIN machines
    (its last call runs) and ``ready`` says the participants are everyone it waits for,
    this machine closes it."""
    _polling.ready = ready
    try:
        yield
    finally:
        _polling.ready = None


def _may_close(ready: Ready, ctx: Any) -> bool:
    """torch's own conditions for closing at the end of the last call, but the time."""
    state, settings = ctx.state, ctx.settings
    return (not state.complete and not state.closed and state.deadline is not None
            and ctx.node in state.participants
            and settings.min_nodes <= len(state.participants) <= settings.max_nodes
            and ready({(node.addr, node.pid) for node in state.participants}))


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
    state = torch_internals.operation_state(executor)
    seen = _signature(state)
    if seen != _polling.seen:
        _polling.seen, _polling.interval = seen, FIRST_POLL
    time.sleep(min(_polling.interval, seconds))
    closer = state.deadline is not None and getattr(_polling, "ready", None) is not None
    _polling.interval = min(_polling.interval * 2, LAST_CALL_POLL if closer else LONGEST_POLL)


def _run(self: Any, *args: Any, **kwargs: Any) -> None:
    ready = getattr(_polling, "ready", None)
    if ready is not None and args:  # torch passes the operation first
        args = (torch_internals.completing_join(
            args[0], lambda ctx: _may_close(ready, ctx)), *args[1:])
    _polling.executor, _polling.seen, _polling.interval = self, None, FIRST_POLL
    try:
        _torch_run(self, *args, **kwargs)
    finally:
        _polling.executor = None


# torch's own two: outside an operation, torch's pace; an operation runs as torch runs it.
_torch_delay, _torch_run = torch_internals.pace_rendezvous_polls(_delay, _run)
