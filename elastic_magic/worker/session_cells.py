"""A session's side of a worker: the rank's persistent namespace, interrupts that reach only
running code, and the end-of-cell mark on the output streams.

A session's cells (``Payload.session``) run one after another in the same ``__main__``
module, so what one cell defines the next one sees. Ctrl-C in the kernel reaches a rank as an
:class:`~elastic_magic.wire.messages.Interrupt` on its control pipe: the listener thread signals
the main thread (a blocking call returns with EINTR), and the handler raises
KeyboardInterrupt only while a cell runs, so an interrupt that arrives as the cell ends never
breaks the report being written.
"""

from __future__ import annotations

import builtins
import os
import signal
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from elastic_magic.worker import leave
from elastic_magic.worker.stdout import cell_end

_module: types.ModuleType | None = None
_busy = False  # a cell's code runs on the main thread


def namespace() -> dict[str, Any]:
    """The rank's ``__main__`` namespace, made on first use and kept across cells."""
    global _module
    if _module is None:
        _module = types.ModuleType("__main__")
        _module.__dict__["__builtins__"] = builtins
        signal.signal(signal.SIGINT, _on_interrupt)
    sys.modules["__main__"] = _module
    return _module.__dict__


def _on_interrupt(signum: int, frame: Any) -> None:
    if _busy:
        raise KeyboardInterrupt


@contextmanager
def running_cell() -> Iterator[None]:
    """Interrupts raise KeyboardInterrupt inside this block only, and one that came for this
    cell before the rank began it, at once (the listener notes it before it signals)."""
    global _busy
    _busy = True
    try:
        if leave.asked():
            raise KeyboardInterrupt("before the cell began on this rank")
        yield
    finally:
        _busy = False


def interrupt_main() -> None:
    """From the control listener: interrupt the main thread if it runs a cell."""
    if _busy:
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


def end_output() -> None:
    """Flush the cell's output, then mark its end on both streams, so that the agent knows
    a cell's lines have all arrived before it reports the cell (the mark carries the rank's
    nonce: a line the cell printed cannot end it; ``agent/node/output.py`` takes it out)."""
    mark = cell_end()
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
            os.write(fd, mark)
        except (OSError, ValueError):  # a closed stream: the agent stops waiting for it
            pass


# -- what Session.push/pull/gather run on every rank ------------------------------------


def assign(values: dict[str, Any]) -> None:
    """``Session.push``: set these variables in the rank's namespace."""
    namespace().update(values)


def value_of(name: str, rank: int | None) -> Any:
    """``Session.pull``/``gather``: the variable ``name`` of this rank (None on other ranks
    than ``rank``, unless it is None: every rank's)."""
    if rank is not None and int(os.environ.get("RANK", "0")) != rank:
        return None
    space = namespace()
    if name not in space:
        raise NameError(f"rank {os.environ.get('RANK', '0')} has no variable named {name!r}")
    return space[name]
