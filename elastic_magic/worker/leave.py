"""Survivors stay (DESIGN decision 23), the worker's side: leaving a payload on the agent's
word without leaving the process.

A rank whose peer died usually learns it from its own collective (gloo errors once the
dead peer's socket closes). One that computes, or waits in a collective that does not
error, is told by the agent (:class:`~elastic_magic.messages.Interrupt`): the control listener
signals the main thread (a blocking call returns with EINTR) and Python's SIGINT handler
raises KeyboardInterrupt there; the runner tells it from a user's interrupt by
:func:`asked`. The signal goes only while the payload's code runs (:func:`leavable`), so
an Interrupt that arrives as the payload ends never breaks the report being written.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_asked = threading.Event()
_lock = threading.Lock()
_busy = False  # the payload's code runs on the main thread


def ask() -> None:
    """From the control listener: leave the payload now, if it still runs."""
    with _lock:
        _asked.set()
        if _busy:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def asked() -> bool:
    """The agent asked this rank to leave its payload (not a user's interrupt)."""
    return _asked.is_set()


def begin() -> None:
    """A new payload starts: an Interrupt meant for the one before does not end it."""
    _asked.clear()


@contextmanager
def leavable() -> Iterator[None]:
    """The payload's code: an Interrupt interrupts it here, and only here (one that came while
    the payload was being set up, at once)."""
    global _busy
    with _lock:
        if _asked.is_set():
            raise KeyboardInterrupt
        _busy = True
    try:
        yield
    finally:
        with _lock:
            _busy = False
