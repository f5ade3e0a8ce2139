"""The machines a job asks a launcher for, kept at a target as allocations come and go.

The head's agent owns one Cluster per job or session with a launcher. It asks for the
job's MAX machines less the head at once; the job starts as soon as its MIN are there and
grows as more allocations start (the rendezvous takes each machine that joins). A thread
polls the scheduler every few seconds: an allocation that ended without being cancelled
(preempted, failed, timed out) is replaced while the target wants it; ``scale`` moves the
target (more: submitted; fewer: pending ones cancelled first, then the newest running).
One whose machine ran in the job is replaced only once the head has heard that machine's
link end (``left``): by then the head knows whether it left because the job is over
(``ending``: its machines go first, and none is asked for any more).
A machine that fails to come up (the scheduler refused it, or its allocation ended before
its machine joined the job) is asked for again only after a delay that doubles each time;
after MAX_FAILURES in a row no more are asked until the next ``scale``, and the status says
so with the last failure's reason. A machine that joins ends the streak.
What every allocation is doing, with the scheduler's reason for those that wait, goes to
``publish`` (the job's status). A :class:`Watchdog` in a session of its own holds what
would end each allocation (and, with a launcher's ``prepare_start``, what undoes a
submission before it runs), and runs it if the kernel dies before ``close``. A cancel the
scheduler did not confirm stays with the watchdog and is asked again after a delay that
doubles, for up to CANCEL_PATIENCE; if ``close`` cannot end them all, the watchdog goes on
asking on its own. A machine that comes up in an allocation cancelled here (``given_back``)
is not the job's: the head sends it away.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import JoinRequest, Launcher, LauncherError, make_launcher
from .watchdog import PATIENCE, Watchdog

if TYPE_CHECKING:
    from ..spec import JobSpec

POLL_INTERVAL = 2.0
RETRY_DELAY = 5.0  # after a machine failed to come up; doubled for each failure in a row
RETRY_DELAY_MOST = 60.0
MAX_FAILURES = 5  # in a row: then no machine is asked for until the next scale
CANCEL_PATIENCE = 600.0  # seconds an unconfirmed cancel is asked again for (then at close)


class StartFailures:
    """Machines that failed to come up, in a row: the next is asked for after a delay that
    doubles each time, and none after ``most`` until the streak is reset."""

    def __init__(self, delay: float, most: int) -> None:
        self.first_delay = delay
        self.most = most
        self.count = 0
        self.last = ""  # the last failure's reason
        self.retry_at = 0.0  # time.monotonic() before which none is asked for

    def failed(self, what: str) -> None:
        self.count += 1
        self.last = what
        self.retry_at = time.monotonic() + self.delay()

    def reset(self, at_once: bool = True) -> None:
        """One came up (the streak ends), or the user asked (``at_once``: no delay)."""
        self.count = 0
        if at_once:
            self.retry_at = 0.0

    def delay(self) -> float:
        return min(self.first_delay * 2 ** (self.count - 1), RETRY_DELAY_MOST)

    def may_start(self) -> bool:
        return self.count < self.most and time.monotonic() >= self.retry_at

    def lines(self) -> tuple[str, ...]:
        if not self.count:
            return ()
        streak = f"{self.count} failed in a row; the last: {self.last}"
        if self.count >= self.most:
            return (f"no more machines asked for ({streak}); `%elastic scale --nodes N` "
                    "asks again",)
        return (f"asking for a machine again in {self.delay():g}s ({streak})",)


class Cancels:
    """Every allocation the Cluster cancelled, and those whose cancel the scheduler did not
    confirm: asked again after a delay that doubles, for up to CANCEL_PATIENCE."""

    def __init__(self) -> None:
        self.given_back: set[str] = set()  # confirmed or not
        self._unconfirmed: dict[str, tuple[float, float, int]] = {}  # first, next, tries

    def due(self) -> list[str]:
        now = time.monotonic()
        return [i for i, (_, retry_at, _) in list(self._unconfirmed.items()) if now >= retry_at]

    def failed(self, allocation_id: str) -> str:
        """Its cancel failed: when it is asked again, said."""
        now = time.monotonic()
        first, _, tries = self._unconfirmed.get(allocation_id, (now, now, 0))
        delay = min(2.0 ** tries, RETRY_DELAY_MOST)
        if now + delay - first <= CANCEL_PATIENCE:
            self._unconfirmed[allocation_id] = (first, now + delay, tries + 1)
            return f"asking again in {delay:g}s"
        self._unconfirmed.pop(allocation_id, None)
        return "asked again when the job ends"

    def confirmed(self, allocation_id: str) -> None:
        self._unconfirmed.pop(allocation_id, None)


class Cluster:
    """A job's other machines, kept at ``target`` by a thread (see the module docstring)."""

    def __init__(self, launcher: Launcher, request: JoinRequest, *, machines: int,
                 publish: Callable[[tuple[str, ...]], None],
                 release: Callable[[str], None] | None = None,
                 poll_interval: float = POLL_INTERVAL, retry_delay: float = RETRY_DELAY,
                 max_failures: int = MAX_FAILURES) -> None:
        self.launcher = launcher
        self.request = request
        self.target = machines  # other machines than the head
        self.publish = publish
        # gives a running machine back at the job's next commit (the head's agent); it
        # then calls cancel_later. None: running machines are cancelled at once.
        self.release = release
        self._releasing: list[str] = []  # asked to leave at a commit; then cancelled
        self._to_cancel: list[str] = []
        self.poll_interval = poll_interval
        self.failures = StartFailures(retry_delay, max_failures)
        self._joined: set[str] = set()  # allocations whose machine joined the job
        self._arrived: list[str] = []  # joined since the last step (from the agent's thread)
        self._gone: list[str] = []  # their machine's link ended since (the agent's thread)
        self._left: set[str] = set()  # joined, and the head heard their machine's link end
        self._ending = False  # the job is over: nothing more is asked for or replaced
        self._rescaled = False  # a scale since the last step: ask again at once
        self.watchdog: Watchdog | None = None  # started by the thread (see _run)
        self._live: list[str] = []  # allocation ids, oldest first
        self._ended: list[str] = []  # what ended unasked, described, for the status
        self._files: list[str] = []  # the launcher's, given to the watchdog to remove
        self.cancels = Cancels()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._shown: tuple[str, ...] = ()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"elastic-launcher-{request.run_id}")

    def start(self) -> Cluster:
        self._thread.start()
        return self

    def scale(self, machines: int) -> None:
        """Keep ``machines`` other machines (the head not counted) from now on."""
        self.target = machines
        self._rescaled = True
        self._wake.set()

    def joined(self, allocation_id: str) -> None:
        """The allocation's machine joined the job (from the agent's thread): it came up."""
        self._arrived.append(allocation_id)
        self._wake.set()

    def left(self, allocation_id: str) -> None:
        """The allocation's machine's link to the head ended (from the agent's thread,
        after all it said there): if the allocation ended, it may be replaced."""
        self._gone.append(allocation_id)
        self._wake.set()

    def ending(self) -> None:
        """The job is over (from the agent's thread, before its machines' links end): its
        machines leave now, and none is replaced or asked for."""
        self._ending = True
        self._wake.set()

    def _run(self) -> None:
        # The agent's thread blocks SIGINT and SIGTERM, and what it starts inherits the
        # mask: ssh, sbatch and the watchdog must be stoppable as usual.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        with self._lock:
            if self._closed.is_set():
                return
            self.watchdog = Watchdog()
        while not self._closed.is_set():
            with self._lock:
                if self._closed.is_set():
                    return
                self._step()
            self._wake.wait(self.poll_interval)
            self._wake.clear()

    def cancel_later(self, allocation_id: str) -> None:
        """Its machine has left the job: end the allocation (from the cluster's thread)."""
        self.cancels.given_back.add(allocation_id)  # now: a Hello from it is not let in
        self._to_cancel.append(allocation_id)
        self._wake.set()

    def given_back(self, allocation_id: str) -> bool:
        """Whether it was cancelled, confirmed or not (from any thread): a machine that
        comes up in it after all is not the job's, and is sent away."""
        return allocation_id in self.cancels.given_back

    def _step(self) -> None:
        # Before _ending is read: the agent says ending before the links end.
        while self._gone:
            self._left.add(self._gone.pop(0))
        while self._to_cancel:
            allocation_id = self._to_cancel.pop(0)
            if allocation_id in self._releasing:
                self._releasing.remove(allocation_id)
            self._cancel(allocation_id)
        for allocation_id in self.cancels.due():
            self._cancel(allocation_id)
        while self._arrived:
            self._joined.add(self._arrived.pop(0))
            self.failures.reset(at_once=False)
        if self._rescaled:  # the user asked: a fresh try, at once
            self._rescaled = False
            self.failures.reset()
        try:
            allocations = self.launcher.allocations()
        except LauncherError as exc:
            self._show((f"the scheduler cannot be asked: {exc}",))
            return
        for allocation in allocations:
            if allocation.state == "ended" and allocation.id in self._releasing:
                self._releasing.remove(allocation.id)
                self._forget(allocation.id)
            elif allocation.state == "ended" and allocation.id in self._live:
                if self._ending:  # the job is over: its machines went first
                    self._forget(allocation.id)
                    continue
                if allocation.id in self._joined and allocation.id not in self._left:
                    continue  # whether the job's end took it is the head's to say, soon
                self._ended = [*self._ended[-4:], allocation.describe()]
                self._forget(allocation.id)
                if allocation.id in self._joined:  # it ran in the job (a preemption, say)
                    self.failures.reset()
                else:
                    why = f": {allocation.reason}" if allocation.reason else ""
                    self.failures.failed(f"{allocation.id} ended before its machine "
                                         f"joined{why}")
        live = [a for a in allocations if a.state != "ended"]
        while len(self._live) < self.target and not self._ending \
                and self.failures.may_start():
            assert self.watchdog is not None
            try:
                undo = self._prepare_start()
                started = self.launcher.start(self.request)
            except LauncherError as exc:  # what undoes it stays held: it may have submitted
                self.failures.failed(f"cannot start a machine: {exc}")
                break
            finally:  # a token file written for a start that failed is the job's too
                self._guard_files()
            self._live.append(started.id)
            self.watchdog.add(started.id, self.launcher.orphan_cleanup(started.id))
            if undo is not None:
                self.watchdog.drop(undo)
            live.append(started)
        if len(self._live) > self.target:
            pending = [a.id for a in live if a.state == "pending"]
            # what has not started is given back first, then the newest machines
            order = [i for i in reversed(self._live) if i in pending] + \
                [i for i in reversed(self._live) if i not in pending]
            for allocation_id in order[:len(self._live) - self.target]:
                if allocation_id in pending or self.release is None:
                    self._cancel(allocation_id)
                    live = [a for a in live if a.id != allocation_id]
                else:  # it leaves at the job's next commit, then is cancelled
                    self._live.remove(allocation_id)
                    self._releasing.append(allocation_id)
                    self.release(allocation_id)
        wanting = len(self._live) < self.target and not self._ending
        self._show(tuple(a.describe() for a in live) + tuple(self._ended) +
                   (self.failures.lines() if wanting else ()))

    def _prepare_start(self) -> str | None:
        """What undoes the next start (a launcher's optional ``prepare_start``: a key and
        commands), held by the watchdog before it runs, with the files it will write: a
        kernel killed or interrupted while it submits leaves nothing. The key, if any."""
        prepare = getattr(self.launcher, "prepare_start", None)
        if prepare is None:
            return None
        key, commands = prepare(self.request)
        assert self.watchdog is not None
        self.watchdog.add(str(key), commands)
        self._guard_files()
        return str(key)

    def _guard_files(self) -> None:
        assert self.watchdog is not None
        for path in self.launcher.orphan_files():
            if path not in self._files:
                self._files.append(path)
                self.watchdog.remove(path)

    def _cancel(self, allocation_id: str) -> None:
        self.cancels.given_back.add(allocation_id)
        failed = f"{allocation_id}: cancel failed"
        self._ended = [line for line in self._ended if not line.startswith(failed)]
        try:
            self.launcher.cancel(allocation_id)
        except LauncherError as exc:
            # Not confirmed: the watchdog keeps it, and it is asked again (then at close).
            again = self.cancels.failed(allocation_id)
            self._ended = [*self._ended[-4:], f"{failed} ({again}): {exc}"]
            self._forget(allocation_id, guarded=True)
            return
        self.cancels.confirmed(allocation_id)
        self._forget(allocation_id)

    def _forget(self, allocation_id: str, guarded: bool = False) -> None:
        """``guarded``: the watchdog keeps it (its cancel is not confirmed)."""
        if allocation_id in self._live:
            self._live.remove(allocation_id)
        self._left.discard(allocation_id)
        if self.watchdog is not None and not guarded:
            self.watchdog.drop(allocation_id)

    def _show(self, lines: tuple[str, ...]) -> None:
        lines += tuple(f"{i}: leaving at the next commit" for i in self._releasing)
        if lines != self._shown:
            self._shown = lines
            self.publish(lines)

    def close(self) -> None:
        """Every allocation ended (the launcher's cancel_all), the watchdog let go; safe
        to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        with self._lock:  # a start under way finishes first, so nothing is missed
            shown: tuple[str, ...] = ()
            try:
                self.launcher.cancel_all()
            except LauncherError as exc:  # the watchdog asks again on its own, for minutes
                shown = (f"the scheduler did not confirm every cancel ({exc}); asking again "
                         f"for up to {PATIENCE / 60:g} minutes",)
                if self.watchdog is not None:
                    self.watchdog.finish()
            except BaseException:
                if self.watchdog is not None:
                    self.watchdog.finish()
                raise
            else:
                if self.watchdog is not None:
                    self.watchdog.close()  # only now: what it holds is ended
            finally:
                self._live.clear()
                self._releasing.clear()
                self._show(shown)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


def start_cluster(spec: JobSpec, endpoint: str, token: str, run_id: str,
                  publish: Callable[[tuple[str, ...]], None],
                  release: Callable[[str], None] | None = None,
                  machines: int | None = None) -> Cluster:
    """The job's machines asked of its --launcher, at once: ``machines`` (default: all
    but the head)."""
    assert spec.launcher is not None
    launcher = make_launcher(spec.launcher, spec.launch)
    request = JoinRequest(endpoint, token, run_id)
    return Cluster(launcher, request,
                   machines=spec.max_nodes - 1 if machines is None else machines,
                   publish=publish, release=release).start()
