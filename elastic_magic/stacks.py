"""Python stacks of a running rank, taken without stopping it, and where they say it waits.

A worker's control-listener thread captures every thread's stack on request
(``sys._current_frames()``: the main thread may be asleep or inside a collective, both of
which release the GIL). The agent formats them for people and classifies them: a rank
whose main thread is inside ``torch.distributed`` waits in a collective; any other rank is
somewhere of its own. A failed rank's frames are dropped here too (:func:`drop_locals`),
so that the error it keeps does not keep its objects. Pure stdlib, so workers import it for
nothing.
"""

from __future__ import annotations

import linecache
import sys
import threading
import traceback
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import FrameType

CELL_FILENAME = "<cell>"  # the file name a cell runs under in the workers
PACKAGE_DIR = str(Path(__file__).resolve().parent)  # our frames, not the user's
# Our own threads in a worker (the control listener, the progress sampler): not the user's.
SERVICE_THREAD_PREFIX = "elastic-"
# Files of torch that mean "waiting for the other ranks" when the main thread is in them.
# DDP's gradient all-reduce runs on autograd threads: a rank blocked there shows
# torch/autograd instead, and is told apart by when it last made progress.
_COLLECTIVE_PATHS = ("torch/distributed/", "torch/nn/parallel/")
_TORCH_PATH = "/torch/"


@dataclass(frozen=True)
class Frame:
    """One call in a captured stack: its file, line, function and source text (a cell's
    lines under ``<cell>``)."""

    file: str
    line: int
    function: str
    text: str = ""

    @property
    def in_cell(self) -> bool:
        return self.file == CELL_FILENAME

    def format(self) -> str:
        where = (f"Cell line {self.line}" if self.in_cell
                 else f'File "{self.file}", line {self.line}')
        source = f"\n    {self.text}" if self.text else ""
        return f"  {where}, in {self.function}{source}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a rank, as captured: its name, whether it is the main thread, its calls."""

    name: str
    main: bool
    frames: tuple[Frame, ...]  # outermost first, as in a traceback

    def format(self) -> str:
        title = f"Thread {self.name}{' (main)' if self.main else ''}, most recent call last:"
        return "\n".join([title, *(f.format() for f in self.frames)])


@dataclass(frozen=True)
class RankStacks:
    """One rank's threads, or a note saying why there are none (it did not answer, it has
    finished)."""

    rank: int
    threads: tuple[ThreadStack, ...] = ()
    note: str = ""

    @property
    def main(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.main), None)

    def format(self) -> str:
        parts = [t.format() for t in self.threads]
        return "\n\n".join([self.note, *parts] if self.note else parts)


# -- in the worker ----------------------------------------------------------------------


def _frames(frame: FrameType, *, trim: bool) -> tuple[Frame, ...]:
    """A frame's stack, outermost first. ``trim`` drops the worker's own frames around the
    user's code (runpy, the entrypoint, the runner) unless nothing else is left."""
    found: list[Frame] = []
    current: FrameType | None = frame
    while current is not None:
        code = current.f_code
        line = current.f_lineno or 0
        text = linecache.getline(code.co_filename, line).strip()
        found.append(Frame(code.co_filename, line, code.co_name, text))
        current = current.f_back
    found.reverse()
    if trim:
        # The interpreter's runner (agent/node/interpreter.py) is the outermost frame: ``-c``
        start = 1 if found and found[0].file == "<string>" else 0
        while start < len(found) and _ours(found[start]):
            start += 1
        if start < len(found):
            found = found[start:]
    return tuple(found)


def _ours(frame: Frame) -> bool:
    return frame.file.startswith((PACKAGE_DIR, "<frozen "))


def capture() -> tuple[ThreadStack, ...]:
    """Every thread's stack except the worker's service threads, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main_id = threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, f"<thread {ident}>")
        if name.startswith(SERVICE_THREAD_PREFIX):
            continue
        stacks.append(ThreadStack(name, ident == main_id, _frames(frame, trim=True)))
    stacks.sort(key=lambda t: not t.main)
    return tuple(stacks)


def position(frame: FrameType | None) -> tuple[tuple[int, int], ...]:
    """Where a thread is: each frame's code and line. Compared between samples to tell
    whether the thread moved."""
    where = []
    while frame is not None:
        where.append((id(frame.f_code), frame.f_lineno or 0))
        frame = frame.f_back
    return tuple(where)


# -- in the agent: where a rank is --------------------------------------------------------


class RankActivity(Enum):
    """What a rank's main thread was doing when its stacks were asked for, as far as they
    tell: waiting on the other ranks or not."""

    COLLECTIVE = "collective"  # the main thread waits inside torch.distributed
    OUTSIDE = "outside"  # somewhere of its own (user code, a sleep, a data loader)
    SILENT = "silent"  # no answer: stuck in C code that holds the GIL, or gone


@dataclass(frozen=True)
class RankPosition:
    """Where a rank's stacks put it, read from its main thread: what it was doing, the
    collective it waits in and the cell line it was on."""

    where: RankActivity
    operation: str = ""  # the collective, e.g. "all_reduce"
    cell_line: int | None = None  # the innermost cell line on the main thread
    source_line: str = ""

    def describe(self) -> str:
        at = f" at cell line {self.cell_line}" if self.cell_line else ""
        if self.where is RankActivity.COLLECTIVE:
            return f"waiting in a collective ({self.operation}{at})"
        if self.where is RankActivity.SILENT:
            return "not answering (stuck in C code holding the GIL?)"
        return f"outside any collective{at}"


def _collective(path: str) -> bool:
    return _TORCH_PATH in path and any(p in path for p in _COLLECTIVE_PATHS)


def place_of(stacks: RankStacks) -> RankPosition:
    """Where the main thread is: inside a collective when its innermost frames (those in
    torch) reach into torch.distributed."""
    main = stacks.main
    if main is None:
        return RankPosition(RankActivity.SILENT)
    frames = main.frames
    cell = [f for f in frames if f.in_cell]
    line = cell[-1].line if cell else None
    text = cell[-1].text if cell else ""
    operation = ""
    for frame in reversed(frames):  # innermost first, while still inside torch
        if _TORCH_PATH not in frame.file:
            break
        if _collective(frame.file) and frame.function != "wrapper":
            operation = frame.function  # the outermost one: the call the user made
    if operation:
        return RankPosition(RankActivity.COLLECTIVE, operation, line, text)
    return RankPosition(RankActivity.OUTSIDE, "", line, text)


def drop_locals(error: BaseException | None) -> None:
    """Drop the variables of every frame in ``error``'s traceback and in the tracebacks of
    the errors it chains to (``raise ... from``, an error raised while handling another):
    any of those frames may hold a model, a DDP reducer or an agent's stores, alive for as
    long as the error is kept. The tracebacks still print."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__,
                    *getattr(current, "exceptions", ())]  # an exception group's own
