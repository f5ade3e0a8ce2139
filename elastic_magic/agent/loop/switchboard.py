"""The agent's side of its inbox: items are read on the agent's thread only, each handed to
the loop first (a session's cells, its interrupts: ``loop_items``), then to the engine; the
most urgent action asked for is remembered (``heard``)."""

from __future__ import annotations

import queue
from collections.abc import Callable

from ...wire.messages import Action
from ..inbox import Inbox, InboxItem
from ..policy import most_urgent


class Switchboard:
    """Reads one agent's inbox. ``dispatch`` handles what the loop passes on; ``check``
    runs before each wait (it may raise: the rendezvous store held a forgery)."""

    def __init__(self, inbox: Inbox, dispatch: Callable[[InboxItem], Action | None],
                 check: Callable[[], None]) -> None:
        self.inbox = inbox
        self.dispatch = dispatch
        self.check = check
        self.loop_items: Callable[[InboxItem], InboxItem | None] = lambda item: item
        # The most urgent action heard: a stop, or another machine's failure for good,
        # holds for the rest of the job; a regroup (a membership change) for one group.
        self.heard: Action | None = None

    def close(self) -> None:
        """The job has ended: let go of the engine's and the loop's methods, which would
        otherwise hold them (and the payload they keep) in a cycle that only the garbage
        collector frees."""
        self.dispatch = _nothing
        self.check = _ignore
        self.loop_items = lambda item: item

    def next_action(self, timeout: float) -> Action | None:
        """Handle what arrives within ``timeout`` (then whatever else is queued); the most
        urgent action asked for, latched ones included."""
        self.check()
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return self.latched()
        return most_urgent(self.handle(item), self.drain())

    def drain(self) -> Action | None:
        """Handle queued items without waiting; the most urgent action, latched included."""
        action = None
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            action = most_urgent(action, self.handle(item))
        return most_urgent(action, self.latched())

    def latched(self) -> Action | None:
        """A stop, or another machine's failure for good, once heard, stays in force."""
        return self.heard if self.heard in (Action.STOP, Action.NODE_FAILED) else None

    def handle(self, item: InboxItem) -> Action | None:
        """One item: the loop's own first, then the engine's."""
        mine = self.loop_items(item)
        action = None if mine is None else self.dispatch(mine)
        self.heard = most_urgent(self.heard, action)
        return action

    def new_group(self) -> None:
        """A regroup heard was for the group before."""
        if self.heard is Action.REGROUP:
            self.heard = None


def _nothing(item: InboxItem) -> Action | None:
    return None


def _ignore() -> None:
    pass
