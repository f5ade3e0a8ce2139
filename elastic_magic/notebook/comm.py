"""The kernel side of the JupyterLab extension (labextension/): one comm target,
``elastic_magic``, over which the "Elastic jobs" panel gets this kernel's jobs and sends
actions (stop, resize, stacks). The frontend opens the comm: the kernel announces the target
when the extension loads (and at a job's start while no frontend has opened one).

Only a frontend connected to this kernel's own channels (authenticated by the kernel's
connection key) can open or write to a comm, so the actions need no other check. Items are a
generic list: ``kind`` "job" (a ``%%elastic`` cell) or "session" (``%elastic session start``,
with the cells it ran); both answer stop, scale and request_stacks. A finished job's record is
sent on request ("record"): a page reloaded before the job ended lost the display the record
replaced, and the extension puts the record in its place. The list also names the user's
detached jobs on this machine that this kernel does not follow ("detached"): the panel
attaches one by running ``%elastic attach RUN_ID`` in a new cell, where its dashboard shows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..agent.handles import attached
from ..spec import SpecError

if TYPE_CHECKING:
    from ..ui.dashboard import PanelView

TARGET = "elastic_magic"
# The announcement's display id and type: a frontend with the extension opens a comm on it.
ANNOUNCE = "application/vnd.elastic-magic.channel+json"
TICK = 1.0  # seconds between updates while a job runs (elapsed time moves)


@dataclass
class ListedJob:
    """A job or session the panel lists, and what only the kernel knew when it started."""

    number: int
    job: Any  # agent.job.Job or session.Session (duck-typed: status, spec, stop, scale)
    cell_id: str | None
    background: bool
    announced: bool = False  # its end was sent as a "finished" message
    kind: str = "job"
    view: PanelView | None = None  # its view's chart, widget and record


def current_cell_id(shell: Any) -> str | None:
    """The id of the notebook cell being executed: JupyterLab and Notebook 7 put it in the
    execute request's metadata (``cellId``)."""
    kernel = getattr(shell, "kernel", None)
    parent: Any = None
    with contextlib.suppress(Exception):
        parent = kernel.get_parent() if kernel is not None else None
    if not parent:
        parent = getattr(shell, "parent_header", None)
    metadata = parent.get("metadata") if isinstance(parent, dict) else None
    cell_id = metadata.get("cellId") if isinstance(metadata, dict) else None
    return cell_id if isinstance(cell_id, str) else None


def describe(item: ListedJob) -> dict[str, Any]:
    """One row of the panel, JSON-friendly: a job's, or a session's (its cells too)."""
    row = describe_job(item)
    if item.kind == "session":
        row["cells"] = item.job.cells
    return row


def describe_job(item: ListedJob) -> dict[str, Any]:
    job = item.job
    status = job.status_snapshot
    spec = job.spec
    result = job.result
    failure = result.failure if result is not None else None
    finished = status.finished or (time.time() if status.done and not status.finished
                                   else None)
    commit = dict(status.last_commit) if status.last_commit else None
    return {
        "kind": item.kind,
        "id": job.run_id,
        "number": item.number,
        "state": status.state.value,
        "done": status.done,
        "world_size": status.world_size,
        "nnodes": status.nnodes,
        "nproc": len(status.shepherds),
        "restarts": status.restarts,
        "max_restarts": spec.max_restarts,
        "started": status.started,
        "elapsed": (finished or time.time()) - status.started,
        "last_commit": commit and {"step": commit.get("step"), "time": commit.get("time")},
        "cell_id": item.cell_id,
        "background": item.background,
        "can_resize": spec.min_nproc != spec.max_nproc,
        "min_nproc": spec.min_nproc,
        "max_nproc": spec.max_nproc,
        "root_cause": (f"rank {failure.rank}: {failure.headline}" if failure is not None
                       else None),
        "summary": result.summary() if result is not None else None,
        # a --launcher's allocations as the job's status has them ("ID: state (reason) on
        # WHERE"): those that wait, with the scheduler's reason (squeue's Reason)
        "machines": list(status.machines),
        "chart": item.view.chart() if item.view is not None else None,
        # the dashboard's widget, and whether its record can be asked for (the cell's
        # display of a page reloaded before the job ended still shows the widget)
        "widget": item.view.widget_id if item.view is not None else None,
        "has_record": item.view is not None and item.view.has_record,
    }


def detached_elsewhere(followed: set[str]) -> list[dict[str, Any]]:
    """The user's detached jobs on this machine that this kernel does not follow (no token:
    attaching reads it from the private connection file)."""
    try:
        found = attached.detached_jobs()
        now = time.time()
        return [{"id": c.run_id, "title": c.title, "elapsed": now - c.started, "pid": c.pid}
                for c in found if c.run_id not in followed]
    except Exception:  # no folder of ours, or an odd file in it: the panel is a convenience,
        return []  # and its thread must go on


def _let_go(item: ListedJob) -> bool:
    """A detached job this kernel stopped following (Ctrl-C, ``detach()``): it runs on, so
    it leaves the kernel's list for the detached ones rather than show a stale state."""
    return getattr(item.job, "detached", False) is True


def _followed(item: ListedJob) -> bool:
    """A job this kernel follows, or whose end it was told (with a result or its agent's
    error): a detached agent keeps its connection file while it winds down after the end,
    and that is not another job to attach to. A job whose link was lost while its agent may
    run on is not followed: the panel offers Attach."""
    return not item.job.done or not item.job.link_lost


def _busy(item: ListedJob) -> bool:
    """A job that has not ended, or a session's cell that runs (its elapsed time moves); or
    one whose view has not finished its chart yet (its last events still to come)."""
    return (not item.job.done and item.job.status_snapshot.state.value != "idle") or \
        (item.view is not None and not item.view.frozen)


class JobsChannel:
    """The comms of this kernel's panel(s) and the thread that updates them while a job
    runs. The thread ends when no tracked job runs: a finished job holds no thread."""

    def __init__(self) -> None:
        self._shell: Any = None  # a Jupyter kernel's: where the announcement goes
        self._comms: list[Any] = []
        self._items: dict[str, ListedJob] = {}
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None
        self._awake_until = 0.0
        self._sent = ""

    # -- set-up ---------------------------------------------------------------------------

    def open(self, shell: Any) -> bool:
        """In a Jupyter kernel: accept the frontends' comms, and tell them the channel is
        here (``announce``). False elsewhere."""
        if getattr(shell, "kernel", None) is None:
            return False
        try:
            from comm import get_comm_manager
        except ImportError:
            return False
        get_comm_manager().register_target(TARGET, self._accept)
        self._shell = shell
        shell.events.register("post_run_cell", self._after_cell)
        self.announce()
        return True

    def _after_cell(self, _result: Any) -> None:
        """A page that missed the announcement (the extension loaded from IPython's config
        before a frontend listened, or inside %%capture) hears it after the next cell."""
        if not self._comms:
            self.announce()

    def announce(self) -> None:
        """Tell every frontend on the kernel's channels that the panel's comm target is
        here; the extension opens a comm to it (``_accept``). Said as an update of a display
        that no cell shows, which nbconvert, papermill and a frontend without the extension
        pass over in silence: a comm the kernel opened itself made each of them warn ("No
        handler found for comm target 'elastic_magic'")."""
        if self._shell is None:
            return
        with contextlib.suppress(Exception):  # the panel is a convenience: never fail a cell
            from IPython.display import update_display

            update_display({ANNOUNCE: {"target": TARGET}}, raw=True, display_id=ANNOUNCE)

    def close(self) -> None:
        with self._lock:
            comms, self._comms = self._comms, []
        for comm in comms:
            with contextlib.suppress(Exception):
                comm.close()
        with contextlib.suppress(Exception):
            from comm import get_comm_manager

            get_comm_manager().unregister_target(TARGET, self._accept)
        with contextlib.suppress(Exception):  # not registered: never opened in a kernel
            self._shell.events.unregister("post_run_cell", self._after_cell)

    def _accept(self, comm: Any, _open_msg: dict[str, Any]) -> None:
        """A frontend opened a comm (a page loaded after the extension)."""
        self._attach(comm)
        self._send(comm, self.message())

    def _attach(self, comm: Any) -> None:
        comm.on_msg(self._on_msg)
        comm.on_close(lambda _msg: self._detach(comm))
        with self._lock:
            self._comms.append(comm)

    def _detach(self, comm: Any) -> None:
        with self._lock:
            if comm in self._comms:
                self._comms.remove(comm)

    # -- jobs -----------------------------------------------------------------------------

    def track(self, number: int, job: Any, cell_id: str | None, background: bool,
              kind: str = "job", view: PanelView | None = None) -> None:
        """List a job; ``view``: what its live view tells the panel (its chart, record)."""
        with self._lock:
            self._items[job.run_id] = ListedJob(number, job, cell_id, background, kind=kind,
                                                view=view)
            unheard = not self._comms
        if unheard:  # a page that loaded after %load_ext, and heard nothing yet
            self.announce()
        self.wake()

    def wake(self) -> None:
        """Update the panel while something runs (a job, or a session's cell that starts
        now); an idle session, like a finished job, holds no thread and sends nothing."""
        with self._lock:
            self._awake_until = time.monotonic() + 3 * TICK  # until the cell shows as running
            if self._ticker is None or not self._ticker.is_alive():
                # "elastic-view-": like a --bg job's view, it ends soon after its jobs do
                self._ticker = threading.Thread(target=self._tick, daemon=True,
                                                name="elastic-view-panel")
                self._ticker.start()

    def track_session(self, number: int, session: Any, cell_id: str | None) -> None:
        """List a session (and drop the ended ones before it: one session at a time)."""
        with self._lock:
            for run_id in [r for r, i in self._items.items()
                           if i.kind == "session" and i.job.done]:
                del self._items[run_id]
        self.track(number, session, cell_id, background=False, kind="session")

    def forget(self, keep: Iterable[Any]) -> None:
        """Drop the jobs the kernel no longer keeps (its bounded history), and list the
        others as it keeps them (an ended job as its EndedJob)."""
        kept = {job.run_id: job for job in keep}
        with self._lock:
            for run_id, item in list(self._items.items()):
                if item.kind != "job":
                    continue
                if run_id in kept:
                    item.job = kept[run_id]
                else:
                    del self._items[run_id]

    def message(self) -> dict[str, Any]:
        with self._lock:
            for run_id in [r for r, i in self._items.items() if _let_go(i)]:
                del self._items[run_id]
            items = list(self._items.values())
        followed = {i.job.run_id for i in items if _followed(i)}
        return {"type": "items", "items": [describe(i) for i in items],
                "detached": detached_elsewhere(followed)}

    def _tick(self) -> None:
        while True:
            # Read before the update it decides on: a view that finishes in between (its
            # record kept) is then sent once more, not left unsaid.
            with self._lock:
                running = time.monotonic() < self._awake_until or any(
                    _busy(i) or (i.job.done and not i.announced)
                    for i in self._items.values())
            self.update()
            if not running:
                return
            time.sleep(TICK)

    def update(self) -> None:
        """Send the list if it changed, and a "finished" message for each job that ended."""
        message = self.message()
        with self._lock:
            ended = [i for i in self._items.values() if i.job.done and not i.announced]
            for item in ended:
                item.announced = True
        text = repr(message)
        if text != self._sent:
            self._sent = text
            self.broadcast(message)
        for item in ended:
            self.broadcast({"type": "finished", "item": describe(item)})

    def broadcast(self, message: dict[str, Any]) -> None:
        with self._lock:
            comms = list(self._comms)
        for comm in comms:
            self._send(comm, message)

    @staticmethod
    def _send(comm: Any, message: dict[str, Any]) -> None:
        with contextlib.suppress(Exception):  # a frontend that went away
            comm.send(message)
        # ipykernel >= 7 routes a comm's incoming messages to the shell that last published
        # on it; ours publish from a thread, so an action would wait behind a running cell.
        if "_reply_subshell_id" in vars(comm):
            with contextlib.suppress(AttributeError):
                del comm._reply_subshell_id

    # -- actions --------------------------------------------------------------------------

    def _on_msg(self, msg: dict[str, Any]) -> None:
        data = msg.get("content", {}).get("data", {})
        if not isinstance(data, dict):
            return
        self.act(data)

    def act(self, data: dict[str, Any]) -> None:
        """Carry out one action from the panel; an error goes back as a message."""
        action, run_id = data.get("action"), data.get("id")
        if action == "refresh":  # the panel shown, or its look at the detached jobs
            self._sent = ""
            self.update()
            return
        with self._lock:
            item = self._items.get(str(run_id))
        if item is None:
            self.broadcast({"type": "error", "id": run_id, "text": f"no job or session {run_id}"})
            return
        job = item.job
        try:
            if action == "stop" and item.kind == "session":
                job.stop(timeout=0)  # its workers leave; the comm's thread does not wait
            elif action == "stop":
                job.stop("stopped from the Elastic jobs panel")
            elif action == "scale" and item.kind == "session":
                job.scale(int(data["nproc"]))  # before the next cell, or at a commit
            elif action == "scale":
                job.scale(int(data["nproc"]), immediate=bool(data.get("now")))
            elif action == "record":  # the finished cell's, for a display a reload lost
                record = item.view.record if item.view is not None else None
                if record is None:
                    raise ValueError(f"{run_id} has no record (yet)")
                self.broadcast({"type": "record", "id": run_id, "bundle": record})
            elif action == "stacks":
                job.request_stacks().add_done_callback(
                    lambda answer: self._send_stacks(job.run_id, answer))
            else:
                raise ValueError(f"unknown action {action!r}")
        except (SpecError, ValueError, KeyError, TypeError) as exc:
            self.broadcast({"type": "error", "id": run_id, "text": str(exc)})
        self.wake()  # show what the action changed (an idle session has no thread running)

    def _send_stacks(self, run_id: str, answer: Future[dict[int, str]]) -> None:
        stacks = answer.result() if answer.exception() is None else {}
        self.broadcast({"type": "stacks", "id": run_id,
                        "ranks": {str(r): text for r, text in sorted(stacks.items())}})
