"""The live dashboard widget (anywidget: one widget for Lab, Notebook 7 and VS Code) and
the view that feeds it from a job's events."""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anywidget
import traitlets
from IPython.display import display

from ..spec import SpecError
from ..wire.events import Event
from .dashboard_state import DashboardState
from .record import record_bundle

# At most this many state messages per second reach the frontend; the charts' series (the
# largest trait) at most once a second.
SYNC_INTERVAL = 0.25
CHARTS_INTERVAL = 1.0
PANEL_POINTS = 120  # the panel's chart is a small one
HERE = Path(__file__).parent


def widget_module() -> str:
    """The widget's ES module: uPlot (vendored from npm, the version the JupyterLab
    extension bundles), the live charts shared with the extension, and the dashboard. A
    module in one text: anywidget loads it without a bundler, offline."""
    charts = (HERE / "live_charts.js").read_text()
    shared = "export function liveCharts("
    assert charts.count(shared) == 1, "live_charts.js exports liveCharts alone"
    return "\n".join([(HERE / "vendor" / "uPlot.iife.min.js").read_text(),
                      charts.replace(shared, "function liveCharts("),
                      (HERE / "dashboard.js").read_text()])


class Dashboard(anywidget.AnyWidget):
    """The dashboard widget itself: the traits a LiveView sets from a DashboardState, drawn
    by ``dashboard.js``; its buttons come back as comm messages."""

    # Text, not paths: anywidget connects every widget made from a path to that file's
    # change signal (for hot reload), which would keep every dashboard (and its job's
    # result) alive for the kernel's life.
    _esm = widget_module()
    _css = "\n".join((HERE / name).read_text() for name in (
        "vendor/uPlot.min.css", "live_charts.css", "dashboard.css"))

    header = traitlets.Dict().tag(sync=True)
    ranks = traitlets.List[int]().tag(sync=True)
    lines = traitlets.Dict().tag(sync=True)  # "rank" -> [[stream, text], ...], bounded
    merged = traitlets.List[list[Any]]().tag(sync=True)  # [[rank, stream, text], ...], bounded
    hidden = traitlets.Dict().tag(sync=True)  # "rank" -> lines only in the log
    logs = traitlets.Dict().tag(sync=True)  # "rank" -> {"stdout": path, "stderr": path}
    timeline = traitlets.List[dict[str, Any]]().tag(sync=True)
    failure = traitlets.Dict().tag(sync=True)
    stacks = traitlets.Dict().tag(sync=True)  # {"title", "time", "ranks": {"0": text}}
    controls = traitlets.Dict().tag(sync=True)  # which controls are live
    earlier = traitlets.List[dict[str, Any]]().tag(sync=True)  # groups before a restart/resize
    charts = traitlets.Dict().tag(sync=True)  # Charts.live(): series, marks, colours

    def __repr__(self) -> str:
        """The text a page that draws no widget shows (nbconvert, papermill, GitHub), not
        an object's address: which job, and how to ask where it stands. (A live page swaps
        the widget for the job's record when it ends.)"""
        run_id = self.header.get("run_id", "?")
        return (f"elastic job {run_id}: its live dashboard shows where widgets are drawn; "
                f"`%elastic status {run_id}` prints where it stands")

    def close(self) -> None:
        """Close its comm and its layout's (a widget of its own, which ipywidgets leaves
        open): a finished cell leaves no comm behind."""
        layout = self.layout
        super().close()
        layout.close()


def _keep_commands_on_subshells(widget: Dashboard) -> None:
    """ipykernel >= 7 routes a comm's incoming messages to the subshell that last published
    on it. Our syncs come from the cell's own (main) shell, so a Stop click would wait behind
    the running cell; forgetting that route lets the frontend's subshell take it."""
    comm = getattr(widget, "comm", None)
    if comm is not None and "_reply_subshell_id" in vars(comm):
        with contextlib.suppress(AttributeError):
            del comm._reply_subshell_id


class PanelView:
    """What the panel keeps of one job's view, read from any thread: its small chart (the
    world size and its marks), drawn from the view's state while the view lives, then what
    it was when the view finished; its widget's id; and, once finished, the record that
    replaced the widget (the panel keeps no view or widget of the job; the record holds
    the tails of its output)."""

    def __init__(self, state: DashboardState, widget_id: str) -> None:
        self._state: DashboardState | None = state
        self._final: dict[str, Any] | None = None
        self.widget_id = widget_id
        # The finished cell's record, compressed (the kernel keeps those of a hundred jobs):
        # a page reloaded while the job ran lost the display that the record replaced, and
        # the extension asks for it to put it in the cell.
        self._record: bytes | None = None

    @property
    def frozen(self) -> bool:
        """The view has finished: this is the chart for good (the panel sends it once
        more; before, the job's last events may not be in it yet)."""
        return self._state is None

    def chart(self) -> dict[str, Any]:
        state = self._state
        if state is None:
            assert self._final is not None
            return self._final
        return state.charts.live(list(state.timeline), final=state.final, metrics=False,
                                 points=PANEL_POINTS)

    @property
    def has_record(self) -> bool:
        return self._record is not None

    @property
    def record(self) -> dict[str, Any] | None:
        return None if self._record is None else json.loads(zlib.decompress(self._record))

    def freeze(self, record: dict[str, Any] | None) -> None:
        self._final = self.chart()
        self._record = None if record is None else zlib.compress(json.dumps(record).encode())
        self._state = None


class LiveView:
    """Shows a Dashboard for a job, throttled; at the end swaps it for the static record."""

    def __init__(self, job: Any) -> None:
        self.job = job
        self.state = DashboardState(job.run_id, str(job.log_dir), job.spec.max_restarts)
        spec = job.spec
        self.widget = Dashboard(controls={"stop": True, "stacks": True, "scale": {
            "min": spec.min_nproc, "max": spec.max_nproc}}, **self.state.traits())
        # Comm messages may arrive on a kernel subshell while the cell runs: only enqueue.
        self.widget.on_msg(self._on_message)
        self._handle = display(self.widget, display_id=True)
        self.panel_view = PanelView(self.state, self.widget.model_id)
        self._dirty = self._charts_stale = False
        self._synced_at = self._charted_at = 0.0
        self._stacks: tuple[dict[int, str], float] | None = None  # arrived, not shown yet

    def _on_message(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        command = content.get("command")
        if command == "stop":
            self.job.stop("stop button")
        elif command == "scale":
            try:
                self.job.scale(int(content["nproc"]), immediate=bool(content.get("now")))
                error = ""
            except (SpecError, ValueError, KeyError) as exc:
                error = str(exc)
            # Widget state, not print: output from a comm callback may be lost.
            self.widget.controls = {**self.widget.controls, "error": error}
        elif command == "stacks":
            self.job.request_stacks().add_done_callback(self._stacks_arrived)

    def _stacks_arrived(self, answer: Future[dict[int, str]]) -> None:
        """On the agent thread: hand the stacks to the next render (the cell's thread)."""
        if answer.exception() is None:
            self._stacks = (answer.result(), time.time())

    def _show_stacks(self) -> bool:
        arrived, self._stacks = self._stacks, None
        if arrived is None:
            return False
        stacks, when = arrived
        clock = time.strftime("%H:%M:%S", time.localtime(when))
        self.state.show_stacks(stacks, f"stacks at {clock} (every thread; nothing was "
                                       "stopped)", when)
        return True

    def __call__(self, events: list[Event]) -> None:
        shown = self._show_stacks()  # first: a failure's kept stacks come after an answer
        for event in events:
            self.state.apply(event)
        if shown or events:
            self._dirty = self._charts_stale = True
        now = time.monotonic()
        due = now - self._synced_at >= SYNC_INTERVAL
        charts_due = self._charts_stale and now - self._charted_at >= CHARTS_INTERVAL
        if (self._dirty and (due or self.state.final)) or charts_due:
            self.sync()

    def sync(self) -> None:
        now = time.monotonic()
        charts = now - self._charted_at >= CHARTS_INTERVAL or self.state.final
        with self.widget.hold_sync():  # one message for all changed traits
            for name, value in self.state.traits(charts=charts).items():
                if getattr(self.widget, name) != value:
                    setattr(self.widget, name, value)
        _keep_commands_on_subshells(self.widget)
        self._dirty = False
        self._synced_at = now
        if charts:
            self._charted_at, self._charts_stale = now, False

    def finish(self) -> None:
        """Replace the live widget with a record that needs no kernel and no widget state."""
        record = None
        try:
            record = record_bundle(self.state)
            if self._handle is not None:
                self._handle.update(record, raw=True)
            self.widget.close()
        finally:
            # The widget's handler is this view's method: a cycle that would keep the job
            # (and its result's snapshot, a memory file as large as the training state)
            # until Python's cyclic collector happens to run.
            self.widget.on_msg(self._on_message, remove=True)
            self.panel_view.freeze(record)  # the panel keeps the chart, not the view
