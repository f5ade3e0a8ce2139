"""Survivors stay (``--survivors``), the worker's side: leaving a payload on the agent's
word without leaving the process.

A rank whose peer died usually learns it from its own collective (gloo errors once the
dead peer's socket closes). One that computes, or waits in a collective that does not
error, is told by the agent (:class:`~elastic_magic.wire.messages.Interrupt`): the control listener
signals the main thread (a blocking call returns with EINTR) and Python's SIGINT handler
raises KeyboardInterrupt there; the runner tells it from a user's interrupt by
:func:`asked`. The signal goes only while the payload's code runs (:func:`leavable`, and
from :func:`resume` for a survivor going on in place), so an Interrupt that arrives as the
payload ends never breaks the report being written. An Interrupt is meant for the Run it
follows on the pipe: one that came before the rank began that Run's payload is raised as
the payload's code begins.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from elastic_magic.wire.messages import Run

# An Interrupt is meant for the Run it follows on the control pipe, which the rank may not
# have begun yet: the Runs are numbered as they arrive, and the number of the last one
# received when an Interrupt came is kept. A flag would be lost when cleared as a Run begins,
# or hit the next cell when it came late, as a cell ended.
_lock = threading.Lock()
_received = 0  # Runs received on the control pipe
_interrupted = 0  # of them, the last one received before an Interrupt
_current = 0  # the Run the rank acts on now (taken from the inbox, or put back)
_busy = False  # the payload's code runs on the main thread


def receive(message: Any) -> None:
    """From the control listener: a Run or Exit, numbered, for :func:`next_message`."""
    global _received
    with _lock:
        if isinstance(message, Run):
            _received += 1
        _inbox.put((_received, message))


def ask() -> None:
    """From the control listener: the agent's Interrupt. The payload of the last Run leaves
    now if its code runs, or as it begins."""
    global _interrupted
    with _lock:
        _interrupted = _received
        if _busy:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def asked() -> bool:
    """The agent's Interrupt came for the Run this rank acts on, begun or not (it says
    which interrupt a KeyboardInterrupt is: the agent's, not a signal's)."""
    return 0 < _current <= _interrupted


@contextmanager
def leavable() -> Iterator[None]:
    """The payload's code: an Interrupt interrupts it here, and only here (one that came while
    the payload was being set up, at once)."""
    global _busy
    resume()
    try:
        yield
    finally:
        with _lock:
            _busy = False


def pause() -> None:
    """A survivor left its payload's code and waits in it (``elastic_magic.run``): the
    agent's word is only recorded from now on; one already on its way is taken here."""
    global _busy
    while True:
        try:  # the word can land as the lock is waited for (ask() holds it): again then
            with _lock:
                _busy = False
            signal.pthread_sigmask(signal.SIG_BLOCK, ())  # a call: a pending SIGINT raises
            return
        except KeyboardInterrupt:
            if not asked():  # a user's Ctrl-C, not the agent's word
                raise


def word_while_running() -> bool:
    """The agent's word came for the Run this rank acts on, and its payload's code still
    counts as running (it has not paused): a KeyboardInterrupt now can be that word."""
    return _busy and asked()


def resume() -> None:
    """The survivor's code runs again in its new group: the agent's word interrupts it (one
    that came for the new group's Run already, at once)."""
    global _busy
    with _lock:
        if asked():
            raise KeyboardInterrupt
        _busy = True


@contextmanager
def word_deferred() -> Iterator[None]:
    """The agent's word (a SIGINT to the main thread; a kernel interrupt in a session too)
    waits inside: it is raised as the block ends. ``State.commit`` holds it from the
    collective where the ranks agree on a commit until the commit's send has started: a
    survivor that left between them would hold a commit the agent never got, and roll
    back one further. A gloo or NCCL wait does not return on a signal, so one that comes
    while waiting in that collective (a dead peer) is raised as soon as it returns, as
    without the block. A SIGINT to the whole process (a stop) goes to another thread and
    does not wait."""
    if threading.current_thread() is not threading.main_thread():
        yield  # the word goes to the main thread: nothing of it to hold here
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the mask now, unchanged
    try:  # a word already pending is raised by the call that blocks: the mask is restored
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # one that came is raised here


# -- going on inside the cell (elastic_magic.run): the next group's Run, as the loop gets it

class RerunCell(BaseException):
    """A survivor cannot go on inside its cell (its rank changed, or the job ends): the
    payload ends quietly (it has reported Parked) and the worker's loop takes the message
    that came instead, as after any parked payload."""


_inbox: queue.Queue[tuple[int, Any]] = queue.Queue()  # the agent's Run and Exit, numbered
_put_back: list[tuple[int, Any]] = []
_running: list[Any] = []  # [payload, stay] of the payload that runs now


def next_message() -> Any:
    """The next Run or Exit for the worker's loop (or a survivor going on in its cell): the
    rank acts on it from now on."""
    global _current
    number, message = _put_back.pop() if _put_back else _inbox.get()
    with _lock:
        _current = number
    return message


def put_back(message: Any) -> None:
    """The message just taken, for the worker's loop: the same Run, so an Interrupt that came
    for it still counts."""
    _put_back.append((_current, message))


def running(payload: Any, stay: bool) -> None:
    _running[:] = [payload, stay]


def running_payload() -> tuple[Any, bool] | None:
    """The payload running now and whether it stays (survivors), if any."""
    return (_running[0], _running[1]) if _running else None
