"""``elastic_magic.log``: scalars for the record's charts and ``JobResult.metrics``, from any
cell. A call appends to this rank's buffer (a few microseconds: log every step); the
progress thread sends what gathered at most twice a second, and the rank sends the rest
before its cell's result (or failure, or its exit at a resize), each batch whole and in
order (``flush``), so the series is whole when the cell ends."""

from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ..wire.metrics import Logged, Point, Thinned

if TYPE_CHECKING:
    from ..worker.client import AgentClient

# A rank that logs faster than its reports leave keeps at most this many calls between two
# reports, evenly (``Thinned``).
MAX_BUFFERED = 20_000

_lock = threading.Lock()  # a cell may log from several threads
_sending = threading.Lock()  # one batch on its way at a time: they arrive in order
_buffer: Thinned[tuple[Point, ...]] = Thinned(MAX_BUFFERED)  # a call's points each
_calls = 0  # this rank's log calls: the step where no State has one


def log(step: int | None = None, *, rank: int | str = 0, **scalars: Any) -> None:
    """Log scalars (``loss=..., lr=...``) at a step: the cell's record charts them, and
    ``result.metrics`` holds every point.

    Args:
        step: The x of these points. None: the step of this rank's ``State`` (the one that
            last committed or restored), else the number of this rank's calls so far.
        rank: Whose calls count: a rank's number (0 by default: one curve, not one per
            rank), or "all".
        **scalars: Names and numbers: a Python or numpy number, or a tensor of one element
            (read with ``.item()``, which waits for a GPU tensor's value).

    Raises:
        TypeError: A value is not one number.
        ValueError: ``rank`` is neither a number nor "all".

    Example:
        >>> elastic_magic.log(loss=loss.item(), lr=scheduler.get_last_lr()[0])
    """
    global _calls
    if rank != "all" and not isinstance(rank, int):
        raise ValueError(f"elastic_magic.log(rank={rank!r}): give a rank's number or 'all'")
    if rank != "all" and rank != int(os.environ.get("RANK", "0")):
        return
    now = time.time()
    points = [(name, _number(name, value)) for name, value in scalars.items()]
    with _lock:
        _calls += 1
        at = _current_step() if step is None else step
        at = _calls if at is None else int(at)
        _buffer.add(tuple((now, at, name, value) for name, value in points))


def _number(name: str, value: Any) -> float:
    size = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
    if hasattr(value, "item") and size == 1:  # a tensor or numpy array of one element
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"elastic_magic.log({name}=...): a number, not {type(value).__name__}")


def _current_step() -> int | None:
    from .state import latest_step

    step = latest_step()
    return step if isinstance(step, int) else None


def take() -> Logged | None:
    """What this rank logged since the last take (the report to send), if anything."""
    global _buffer
    with _lock:
        calls, _buffer = _buffer.items(), Thinned(MAX_BUFFERED)
    points = tuple(point for call in calls for point in call)
    return Logged(int(os.environ.get("RANK", "0")), points) if points else None


def flush(client: AgentClient) -> None:
    """Send what was logged since the last flush (from the progress thread, and before the
    cell's end is told): one batch at a time, so they arrive in the order logged."""
    with _sending:
        logged = take()
        if logged is not None:
            with contextlib.suppress(OSError):  # the agent is gone; the lifeline ends us
                client.send(logged)


def reset() -> None:
    """A new cell's calls count from zero (a session's rank runs many)."""
    global _calls, _buffer
    with _lock:
        _calls = 0
        _buffer = Thinned(MAX_BUFFERED)
