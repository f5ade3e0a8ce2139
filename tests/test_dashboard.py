"""The dashboard's state, asserted from Python (traitlets): fed events recorded from real
jobs (tests/recorded_jobs.py) where its rendering is the subject, driven by real jobs where
the job's behaviour is (buttons, output's order, progress bars, forked children), and one
real job end to end."""

from __future__ import annotations

import io
import os
import re
import signal
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import descriptors
from recorded_jobs import Recorded, failed_job, hello_job, lines_by_group, restart_job

from elastic_magic.agent.handles.job import Job
from elastic_magic.result import JobFailedError
from elastic_magic.spec import JobSpec
from elastic_magic.ui.dashboard import Dashboard, LiveView
from elastic_magic.ui.dashboard_state import (
    MERGED_LINES,
    RANK_LINES,
    TRACEBACK_SHOWN,
    DashboardState,
)
from elastic_magic.ui.record import record_bundle
from elastic_magic.ui.text import TextRenderer
from elastic_magic.wire.events import Output, WorkersStarted
from elastic_magic.wire.payload import build_payload

# recorded_jobs.restart_job() is this cell's job (nproc=2, max_restarts=1), as recorded.
FLAKY = textwrap.dedent("""
    import os, sys, time, torch.distributed as dist
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = dist.get_rank()
    for i in range(400):
        print(f"rank {rank} attempt {attempt} line {i}")
    print(f"warning from {rank}", file=sys.stderr)
    dist.barrier()
    if attempt == 0 and rank == 1:
        raise ValueError("first attempt breaks")
    rank
""")


def replayed(recorded: Recorded) -> LiveView:
    """A LiveView fed a recorded job's events as ``job.wait`` feeds it, then finished as the
    magic finishes it; no job runs (the view's job is a stand-in with what it reads of one:
    its name, log folder and spec)."""
    spec = JobSpec.create(recorded.nproc, max_restarts=recorded.max_restarts,
                          log_dir=recorded.log_dir.parent)
    view = LiveView(SimpleNamespace(run_id=recorded.run_id, log_dir=recorded.log_dir,
                                    spec=spec))
    try:
        for event in recorded.events:
            view([event])
    finally:
        view.finish()
    return view


RESTART_TIMELINE = ["rendezvous", "start", "running", "failure", "restart", "rendezvous",
                    "start", "running", "succeeded"]


@pytest.mark.unit
def test_widget_state_follows_a_job_with_a_restart(log_dir):
    """The widget and the record of FLAKY's job (replayed): bounded tails, the earlier
    group, the timeline, the header."""
    view = replayed(restart_job(log_dir))
    w: Dashboard = view.widget
    assert w.header["state"] == "succeeded" and w.header["world_size"] == 2
    assert w.header["nnodes"] == 1 and w.header["restarts"] == 1
    assert w.header["max_restarts"] == 1 and w.header["round"] == 2
    assert w.header["finished_at"] >= w.header["started_at"]
    assert w.ranks == [0, 1]
    for rank in (0, 1):
        lines = w.lines[str(rank)]
        assert len(lines) == RANK_LINES  # bounded in the browser...
        assert w.hidden[str(rank)] == 401 - RANK_LINES  # ...the rest counted, in the log
        # stdout and stderr are separate pipes: order within each stream only
        assert ["stderr", f"warning from {rank}"] in lines
        stdout = [text for stream, text in lines if stream == "stdout"]
        assert stdout[-1] == f"rank {rank} attempt 1 line 399"  # the latest attempt
        assert w.logs[str(rank)]["stdout"].endswith(f"group_1/rank_{rank}/stdout.log")
    assert len(w.merged) == MERGED_LINES
    assert all(text.startswith(f"rank {r} attempt 1") or text == f"warning from {r}"
               for r, _, text in w.merged)
    kinds = [e["kind"] for e in w.timeline]
    assert kinds == RESTART_TIMELINE
    assert "rank 1 failed: ValueError: first attempt breaks" in w.timeline[3]["text"]
    assert w.failure == {}  # the job recovered: no root cause to show
    assert w.timeline[6]["text"] == "started ranks 0, 1 after restart 1"
    # The group before the restart keeps its output, and why it ended.
    assert len(w.earlier) == 1
    first = w.earlier[0]
    assert first["restart"] == 0
    assert first["why"].startswith("ended by a failure: rank 1: ValueError: first attempt")
    assert ["stdout", "rank 0 attempt 0 line 399"] in first["lines"]["0"]
    record = record_bundle(view.state)
    assert "succeeded · world size 2 · 1 machine · restarts 1/1" in record["text/plain"]
    assert "[rank 1] warning from 1" in record["text/plain"]
    assert "[rank 0] rank 0 attempt 0 line 399" in record["text/plain"]
    html = record["text/html"]
    assert "<script" not in html and "Rank 0" in html
    assert "Earlier group (restarts 0): ended by a failure" in html
    # Follows the theme: JupyterLab's variables, no background of its own.
    assert "var(--jp-" in html and "background" not in html
    # Markdown (nbconvert) keeps it one HTML block: one element a line, no blank line.
    assert html.count("\n") > 20 and "\n\n" not in html
    svg = html[html.index("<svg"):html.index("</svg>") + 6].splitlines()
    assert all(line.startswith("<") for line in svg)  # the charts' elements a line each too
    assert max(len(line) for line in html.splitlines()  # a series' points are one line
               if "<pre" not in line and line not in svg[1:-1]) < 300
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", line.split()[0])
               for line in record["text/plain"].split("timeline:\n")[1].splitlines()[:-1])


def watch_live(job, view: LiveView, seen: list) -> None:
    """Wait for ``job`` as the magic does, feeding ``view``, keeping every event in ``seen``."""
    def render(events):
        seen.extend(events)
        view(events)

    try:
        job.wait(render)
    finally:
        view.finish()


def test_live_view_follows_a_real_job_with_a_restart(log_dir):
    """The dashboard on a real job's path, end to end: a LiveView fed by ``job.wait`` (as the
    magic feeds it) while the job fails, restarts and succeeds. The job emits what the unit
    tests replay (recorded_jobs.restart_job: the same lines by group, rank and stream, the
    same timeline), the widget ends synced with the state, and its log paths are the job's."""
    spec = JobSpec.create(log_dir=log_dir, nproc=2, max_restarts=1)
    job = Job(spec, build_payload(FLAKY, spec)).start()
    view, seen = LiveView(job), []
    watch_live(job, view, seen)
    printed, recorded = lines_by_group(seen), lines_by_group(restart_job(log_dir).events)
    assert printed.keys() == recorded.keys()
    for key, lines in recorded.items():  # a rank stopped by the other's failure may say so
        assert printed[key][:len(lines)] == lines and (key[2] == "stderr"
                                                       or printed[key] == lines), key
    w: Dashboard = view.widget
    assert w.header["state"] == "succeeded" and w.header["restarts"] == 1
    assert w.header["round"] == 2 and w.header["world_size"] == 2
    assert w.header["finished_at"] >= w.header["started_at"]
    assert [e["kind"] for e in w.timeline] == RESTART_TIMELINE
    for name, value in view.state.traits().items():  # the last sync came after the end
        assert getattr(w, name) == value, name
    for rank in (0, 1):
        assert w.hidden[str(rank)] == 401 - RANK_LINES
        logged = Path(w.logs[str(rank)]["stdout"]).read_text().splitlines()
        assert logged == [f"rank {rank} attempt 1 line {i}" for i in range(400)]
    assert w.earlier[0]["why"].startswith("ended by a failure: rank 1: ValueError: first")
    record = record_bundle(view.state)["text/plain"]
    assert "succeeded · world size 2 · 1 machine · restarts 1/1" in record


@pytest.mark.unit
def test_failure_is_shown_with_root_cause(log_dir):
    view = replayed(failed_job(log_dir))
    w = view.widget
    assert w.header["state"] == "failed"
    assert w.failure["rank"] == 0 and w.failure["headline"].startswith("ZeroDivisionError")
    assert "Cell line 4" in w.failure["traceback"]
    # Numbered as the JobFailedError numbers it.
    assert w.failure["attempt_label"] == "attempt 1 of 1"
    # The traceback shows once, in the root cause: not again in the rank's own output.
    rank0 = [text for _, text in w.lines["0"]]
    assert TRACEBACK_SHOWN in rank0 and "Traceback (most recent call last):" not in rank0
    html = record_bundle(view.state)["text/html"]
    assert "Root cause: rank 0</b> (attempt 1 of 1)" in html and "ZeroDivisionError" in html
    assert html.count("Traceback (most recent call last)") == 1


def test_stop_message_from_the_frontend_stops_the_job(log_dir):
    spec = JobSpec.create(2, log_dir=log_dir)
    job = Job(spec, build_payload("import time\nprint('up', flush=True)\ntime.sleep(600)",
                                  spec)).start()
    view = LiveView(job)
    sent = []

    def render(events):
        view(events)
        if not sent and any(line[2] == "up" for line in view.widget.merged) and len(
                {line[0] for line in view.widget.merged}) == 2:
            sent.append(True)
            # what the Stop button sends; on a subshell thread in JupyterLab >= 4.4
            view.widget._handle_custom_msg({"command": "stop"}, [])

    try:
        result = job.wait(render)
    finally:
        view.finish()
    assert sent and result.state.value == "stopped" and result.stop_reason == "stop button"
    assert view.widget.header["state"] == "stopped"


@pytest.mark.parametrize("survivors", [False, True], ids=["restart", "survivors-stay"])
def test_a_ranks_first_lines_come_after_its_group_started_and_are_shown(log_dir, survivors):
    """A rank handed its cell first (from the pool, or a survivor, sent it before the new
    ranks start) prints before the others have started: its first lines must not come
    before the group's WorkersStarted, where a view begins the attempt's panes (they were
    dropped there)."""
    cell = textwrap.dedent("""
        import os, torch.distributed as dist, elastic_magic
        print("top", flush=True)
        dist.init_process_group("gloo")  # every rank has printed before rank 0 fails
        state = elastic_magic.State(step=0)  # survivors stay where the cell has one
        if dist.get_rank() == 0 and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 2:
            raise ValueError("again")
        dist.barrier()  # the others lose rank 0 here: they stay, if survivors do
    """)
    spec = JobSpec.create(4, max_restarts=2, log_dir=log_dir, survivors=survivors)
    job = Job(spec, build_payload(cell, spec)).start()
    view, seen = LiveView(job), []
    watch_live(job, view, seen)
    started = set()
    for event in seen:
        if isinstance(event, WorkersStarted):
            started.add(event.attempt)
        elif isinstance(event, Output):
            assert event.attempt in started, f"{event} came before its group started"
    assert started == {0, 1, 2}
    stayed = [e.stayed for e in seen if isinstance(e, WorkersStarted)]
    assert stayed == ([(), (1, 2, 3), (1, 2, 3)] if survivors else [()] * 3)
    groups = [*view.state.earlier, {"lines": view.widget.lines}]
    assert [sorted(int(r) for r, lines in group["lines"].items()
                   if ["stdout", "top"] in [list(line) for line in lines])
             for group in groups] == [[0, 1, 2, 3]] * 3


@pytest.mark.unit
@pytest.mark.parametrize("text", [True, False])
def test_record_renders_without_widget_state(log_dir, text):
    state = DashboardState("em-87700009c70c", str(log_dir), 0)
    for event in hello_job(log_dir).events:
        state.apply(event)
    bundle = record_bundle(state)
    assert set(bundle) == {"text/plain", "text/html"}
    assert "hello" in bundle["text/plain" if text else "text/html"]


RESIZABLE = textwrap.dedent("""
    import time, torch, torch.distributed as dist
    import elastic_magic
    model = torch.nn.Linear(2, 1)
    state = elastic_magic.State(model=model, step=0)
    print("world size", dist.get_world_size(), flush=True)
    while state.step < 12:
        time.sleep(0.1)
        state.step += 1
        state.commit()
    dist.get_world_size()
""")


def test_resize_from_the_dashboard_shows_pending_and_last_commit(log_dir):
    spec = JobSpec.create(2, log_dir=log_dir, min_nproc=1, max_nproc=3)
    job = Job(spec, build_payload(RESIZABLE, spec)).start()
    view = LiveView(job)
    seen = {"pending": None, "errors": []}

    def render(events):  # records what it sees; the assertions come after the job
        for event in events:  # one at a time: a pending resize may last less than a batch
            view([event])
            if view.state.header["pending_resize"]:
                seen["pending"] = view.state.header["pending_resize"]
        header = view.widget.header
        if not seen["errors"] and (header.get("last_commit") or {}).get("step", 0) >= 3:
            for nproc in (9, 3):  # out of bounds, then in
                view.widget._handle_custom_msg({"command": "scale", "nproc": nproc}, [])
                seen["errors"].append(view.widget.controls["error"])

    try:
        result = job.wait(render)
    finally:
        view.finish()
    assert len(seen["errors"]) == 2 and "between 1 and 3 workers" in seen["errors"][0]
    assert seen["errors"][1] == ""
    assert result.ok and result.values == {0: 3, 1: 3, 2: 3} and result.resizes == 1
    w = view.widget
    assert seen["pending"] == 3 and w.header["pending_resize"] is None
    assert w.header["world_size"] == 3 and w.header["last_commit"]["step"] == 12
    assert w.header["last_commit"]["world_size"] == 3
    assert w.controls["scale"] == {"min": 1, "max": 3}
    assert w.header["nproc"] == 3  # the resize box starts at this machine's workers
    assert len(w.earlier) == 1 and w.earlier[0]["why"] == "ended by a resize (2 -> 3 workers here)"
    assert w.earlier[0]["lines"]["1"] == [["stdout", "world size 2"]]
    kinds = [e["kind"] for e in w.timeline]
    assert "resize" in kinds and "membership" in kinds and "restart" not in kinds
    assert "last commit: step 12 at world size 3" in record_bundle(view.state)["text/plain"]


def test_stacks_button_shows_every_rank_without_stopping_the_job(tmp_path, log_dir):
    flag = tmp_path / "go"
    cell = ("import os, time\nprint('up', flush=True)\n"
            "while not os.path.exists(FLAG):\n    time.sleep(0.2)\n")
    spec = JobSpec.create(2, log_dir=log_dir)
    job = Job(spec, build_payload(cell, spec, namespace={"FLAG": str(flag)})).start()
    view = LiveView(job)
    seen: dict = {"asked": False, "stacks": None}

    def render(events):
        view(events)
        up = {rank for rank, _, text in view.widget.merged if text == "up"}
        if not seen["asked"] and up == {0, 1}:
            seen["asked"] = True
            # what the Stacks button sends; on a subshell thread in JupyterLab >= 4.4
            view.widget._handle_custom_msg({"command": "stacks"}, [])
        if seen["asked"] and seen["stacks"] is None and view.widget.stacks:
            seen["stacks"] = dict(view.widget.stacks)
            flag.touch()  # the job goes on to succeed

    try:
        result = job.wait(render)
    finally:
        flag.touch()
        view.finish()
    assert view.widget.controls["stacks"] is True
    stacks = seen["stacks"]
    assert stacks is not None and stacks["title"].startswith("stacks at ")
    assert sorted(stacks["ranks"]) == ["0", "1"]
    for text in stacks["ranks"].values():
        assert "Cell line 4, in <module>\n    time.sleep(0.2)" in text
    assert result.ok and view.widget.header["state"] == "succeeded"
    assert "Rank 0" in record_bundle(view.state)["text/html"]


def test_quiet_result_repr_and_interrupt_without_library_frames(ip, log_dir, tmp_path):
    """A result's repr is one short line whatever the ranks return; an interrupted cell says
    one line (no frames of ours), and each stopped rank one line, not a traceback."""
    result = ip.run_cell_magic("elastic", f"--nproc 2 --text --log-dir {log_dir}",
                               "import torch\ntorch.arange(5000)")
    text = repr(result)
    assert text.startswith("JobResult(succeeded, world size 2, restarts 0/0, ")
    assert "value=tensor([ 0, 1, 2," in text and len(text) < 160

    returned = threading.Event()
    lost: list[str] = []

    def interrupt_when_running():
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("in-cell-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # what a kernel interrupt is
        if not returned.wait(60):  # lost: say how the process held it, then end the cell
            with open("/proc/self/status") as status:
                lost.append(f"{signal.getsignal(signal.SIGINT)} " + " ".join(
                    line.strip() for line in status if line.startswith(("Sig", "ShdPnd"))))
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_running, daemon=True).start()
    ip.user_ns["FLAGS"] = str(tmp_path)
    with pytest.raises(KeyboardInterrupt) as caught:
        try:
            ip.run_cell_magic("elastic", f"--nproc 2 --text --log-dir {log_dir} -o stopped",
                              "import os, time\nrank = os.environ['RANK']\n"
                              "open(os.path.join(FLAGS, f'in-cell-{rank}'), 'w').close()\n"
                              "time.sleep(600)")
        finally:
            returned.set()
    assert not lost, f"the interrupt did not stop the cell within 60 s: {lost}"
    assert caught.value._render_traceback_() == [
        f"KeyboardInterrupt: job {ip.user_ns['stopped'].run_id} was stopped; its workers "
        "have exited"]
    for rank in (0, 1):
        stderr = ip.user_ns["stopped"].log_path(rank, "stderr").read_text()
        assert stderr == "KeyboardInterrupt: stopped\n"
    assert repr(ip.user_ns["stopped"]).startswith("JobResult(stopped, world size 2, ")
    assert ", why=" in repr(ip.user_ns["stopped"])  # what stopped it, in the one line


PROGRESS = textwrap.dedent("""
    import sys, time, torch.distributed as dist
    rank = dist.get_rank()
    print(f"rank {rank} begins", flush=True)
    dist.barrier()  # both bars run at once
    for i in range(101):  # what tqdm writes: each update starts with a carriage return
        sys.stderr.write(f"\\rrank {rank} progress {i:3d}%")
        sys.stderr.flush()
        time.sleep(0.02)
    sys.stderr.write("\\n")
    print(f"rank {rank} ends", flush=True)
""")


def test_progress_bars_update_one_line_per_rank(log_dir):
    spec = JobSpec.create(2, log_dir=log_dir)
    job = Job(spec, build_payload(PROGRESS, spec)).start()
    view = LiveView(job)
    out, err = io.StringIO(), io.StringIO()
    text = TextRenderer(stdout=out, stderr=err, status=False)
    live: list[list] = []  # each rank's rewritten line, as the widget showed it mid-way

    def render(events):
        view(events)
        text(events)
        for rank in ("0", "1"):
            bars = [t for s, t in view.widget.lines.get(rank, []) if "progress" in t]
            assert len(bars) <= 1  # one line per rank, updated in place
            if bars and "100%" not in bars[0]:
                live.append(bars)

    try:
        job.wait(render)
    finally:
        view.finish()
    assert len(live) >= 2 and len({b[0] for b in live}) >= 2  # it moved while it ran
    for rank in (0, 1):
        lines = [t for _, t in view.widget.lines[str(rank)]]
        # stdout and stderr are separate pipes: order within each stream only
        assert sorted(lines) == [f"rank {rank} begins", f"rank {rank} ends",
                                 f"rank {rank} progress 100%"]
        raw = (job.log_dir / "group_0" / f"rank_{rank}" / "stderr.log").read_bytes()
        assert raw.count(b"\r") == 101  # the log keeps every byte
    record = record_bundle(view.state)["text/plain"]
    assert "[rank 1] rank 1 progress 100%" in record and "progress  50%" not in record
    # The text output rewrote one line in place, for both ranks; whole lines went above it.
    shown = err.getvalue()
    assert re.search(r"\[rank 0\] rank 0 progress +\d+% · \[rank 1\] rank 1 progress", shown)
    assert shown.count("\n") == 2 and shown.count("progress 100%\n") == 2


def test_jobs_list_stops_the_clock_of_a_finished_job(ip, log_dir, capsys):
    ip.run_cell_magic("elastic", f"--nproc 1 --text --log-dir {log_dir}", "print('hi')")
    capsys.readouterr()
    ip.run_line_magic("elastic", "jobs")
    first = capsys.readouterr().out
    time.sleep(1.5)  # a clock still running would show more
    ip.run_line_magic("elastic", "jobs")
    assert capsys.readouterr().out == first and "succeeded" in first
    assert re.search(r"restarts 0/0  \d+\.\ds\n", first)
    # a job by its number as the list and the panel write it, a comment after it
    number, run_id = first.splitlines()[-1].split()[:2]
    ip.run_line_magic("elastic", f"status #{number}   # the one that said hi")
    assert run_id in capsys.readouterr().out


@pytest.mark.unit
def test_the_timeline_is_in_time_order_when_another_machine_s_word_comes_in_late():
    """A joined machine's events come through its link, after the head's own later ones
    (its network line arrived after "machine ... joined"): the timeline sorts by time."""
    from elastic_magic.ui.dashboard_state import DashboardState
    from elastic_magic.wire.events import NetworkChosen, NodeConnected

    state = DashboardState("em-test", "/tmp/logs", 0)
    state.apply(NodeConnected("10.0.0.7", 2, True, "", time=100.0))
    state.apply(NetworkChosen("10.0.0.7", "eth0", (), (), "m7", "10.0.0.7", time=99.5))
    state.apply(NodeConnected("10.0.0.8", 2, True, "", time=101.0))
    times = [e["time"] for e in state.timeline]
    assert times == sorted(times) and len(times) == 3, state.timeline


@pytest.mark.unit
def test_an_earlier_group_says_it_ended_for_a_machine_that_joined_or_left():
    from elastic_magic.result import RankFailure
    from elastic_magic.ui.dashboard_state import DashboardState
    from elastic_magic.wire.events import NodeConnected, Output, Restarting, WorkersStarted

    state = DashboardState("em-test", "/tmp/logs", 0)
    for attempt, change in enumerate((NodeConnected("10.0.0.7", 2, True),
                                      NodeConnected("10.0.0.7", 0, False, "preempted"),
                                      None)):
        state.apply(WorkersStarted(attempt, 0, (0,), (100 + attempt,)))
        state.apply(Output(0, "stdout", ("step",), attempt=attempt))
        if change is not None:
            state.apply(change)
    assert [e["why"] for e in state.earlier] == [
        "ended by machine 10.0.0.7 joining the job",
        "ended by machine 10.0.0.7 leaving: preempted"]
    # A failure's reason stands when a machine's word comes after it.
    state.apply(Restarting(1, 3, RankFailure(0, 0, 2, 1, 0.0, exc_type="ValueError")))
    state.apply(NodeConnected("10.0.0.9", 2, True))
    state.apply(WorkersStarted(3, 1, (0,), (103,)))
    assert state.earlier[-1]["why"].startswith("ended by a failure: rank 0: ValueError")


@pytest.mark.unit
def test_a_dashboard_saved_where_no_widget_is_drawn_names_its_job():
    """nbconvert and papermill save a widget's text/plain: a --bg cell's dashboard whose
    record did not replace it in time showed '<...Dashboard object at 0x...>'."""
    from elastic_magic.ui.dashboard import Dashboard

    widget = Dashboard(header={"run_id": "em-abc"})
    try:
        data, _metadata = widget._repr_mimebundle_()
        text = data["text/plain"]
    finally:
        widget.close()
    assert text == ("elastic job em-abc: its live dashboard shows where widgets are drawn; "
                    "`%elastic status em-abc` prints where it stands")


@pytest.mark.unit
def test_join_command_is_in_the_header_and_the_record():
    """A multi-node job's join command: the header (the widget shows it at the top, with a
    Copy button) and the record; not only in the collapsed timeline."""
    from elastic_magic.ui.dashboard_state import DashboardState
    from elastic_magic.wire.events import AcceptingNodes

    state = DashboardState("em-test", "/tmp/logs", 0)
    command = "elastic-magic join 10.0.0.5:29400 --token-file /home/u/.cache/t/em-1"
    state.apply(AcceptingNodes("10.0.0.5:29400", command))
    assert state.traits()["header"]["join_command"] == command
    record = record_bundle(state)
    assert f"Other machines joined with: <code>{command}</code>" in record["text/html"]
    assert record["text/plain"].splitlines()[1] == f"other machines joined with: {command}"


@pytest.mark.unit
def test_log_tails_show_a_rewritten_line_as_it_finally_showed():
    from elastic_magic.notebook.job_commands import visible as _visible

    assert _visible("\r 10%|#\r 50%|#####\r100%|##########|\n") == "100%|##########|\n"
    assert _visible("plain line\n") == "plain line\n" and _visible("done\r\n") == "done\n"
    assert _visible("\x1b[2K\x1b[32mok\n") == "\x1b[32mok\x1b[0m\n"  # as --text shows it


def test_text_failure_shows_its_traceback_once_and_a_bg_handle_says_it_is_live(
        ip, log_dir, capsys):
    """--text: the root cause's traceback is printed once (from its rank's stderr; the
    error points at it), and a --bg cell's printed handle says it is live, until it ends."""
    with pytest.raises(JobFailedError) as caught:
        ip.run_cell_magic("elastic", f"--nproc 2 --text --log-dir {log_dir}",
                          "import torch.distributed as dist\n\n"
                          "def load(rank):\n    if rank == 1:\n"
                          "        raise ValueError('bad shard')\n\n"
                          "load(dist.get_rank())\ndist.barrier()")
    captured = capsys.readouterr()
    rendered = "\n".join(caught.value._render_traceback_())
    shown = captured.out + captured.err + rendered
    assert "[rank 1]     raise ValueError('bad shard')" in captured.err
    assert shown.count("raise ValueError('bad shard')") == 1, shown
    assert "(its traceback is in the output above" in rendered
    assert "ValueError: bad shard (cell line 5)" in rendered  # the one-line summary stays
    assert "raise ValueError" in caught.value.result.failure.traceback  # .result has it

    job = ip.run_cell_magic("elastic", f"--nproc 1 --text --bg --log-dir {log_dir}",
                            "import time\ntime.sleep(1)")
    assert re.fullmatch(rf"<elastic Job {job.run_id}: \w+ at \d\d:\d\d:\d\d; a live handle: "
                        r"show it again, or %elastic status, for its state now>", repr(job))
    assert job.wait_done(timeout=120)
    assert repr(job) == f"<elastic Job {job.run_id}: succeeded>"


COLOURED = r"""
import sys
print('\x1b[2K\x1b[1;35mepoch 1\x1b[0m <b>&', flush=True)
print('\x1b[?25l\x1b[31mred\x1b[0m\x1b[?25h', flush=True)
print('\x1b[33mwarn', file=sys.stderr, flush=True)
"""


def test_colours_are_rendered_cursor_codes_dropped_and_logs_kept_byte_for_byte(log_dir):
    """What ranks print under ipykernel's FORCE_COLOR (rich, Lightning): the widget gets
    plain text and styled runs, the record coloured spans, --text the colours (reset at each
    line's end) without cursor codes; the log keeps every byte."""
    spec = JobSpec.create(1, log_dir=log_dir)
    job = Job(spec, build_payload(COLOURED, spec)).start()
    view = LiveView(job)
    out, err = io.StringIO(), io.StringIO()
    text = TextRenderer(stdout=out, stderr=err, status=False)

    def render(events):
        view(events)
        text(events)

    try:
        job.wait(render)
    finally:
        view.finish()
    magenta = "color: #d160c4; font-weight: bold"
    # stdout and stderr are separate pipes: order within each stream only
    assert sorted(view.widget.lines["0"], key=lambda line: line[0] == "stderr") == [
        ["stdout", "epoch 1 <b>&", [[magenta, "epoch 1"], ["", " <b>&"]]],
        ["stdout", "red", [["color: #e75c58", "red"]]],
        ["stderr", "warn", [["color: #ddb62b", "warn"]]],
    ]
    assert [0, "stdout", "red", [["color: #e75c58", "red"]]] in view.widget.merged
    record = record_bundle(view.state)
    html, plain = record["text/html"], record["text/plain"]
    assert f'<span style="{magenta}">epoch 1</span> &lt;b&gt;&amp;' in html
    assert '<span style="color: #ddb62b">warn</span>' in html
    assert "\x1b" not in html and "\x1b" not in plain
    assert "[rank 0] epoch 1 <b>&\n[rank 0] red" in plain
    assert out.getvalue() == ("[rank 0] \x1b[1;35mepoch 1\x1b[0m <b>&\n"
                              "[rank 0] \x1b[31mred\x1b[0m\n")
    assert err.getvalue() == "[rank 0] \x1b[33mwarn\x1b[0m\n"
    rank_logs = job.log_dir / "group_0" / "rank_0"
    assert (rank_logs / "stdout.log").read_bytes() == (
        b"\x1b[2K\x1b[1;35mepoch 1\x1b[0m <b>&\n\x1b[?25l\x1b[31mred\x1b[0m\x1b[?25h\n")
    assert (rank_logs / "stderr.log").read_bytes() == b"\x1b[33mwarn\n"


def test_text_cell_shows_colours_as_a_plain_cell_does(ip, log_dir, capsys, monkeypatch):
    """ipykernel's FORCE_COLOR reaches the workers; %%elastic --text prints their colours
    (a notebook renders them, as a plain cell's) and drops their cursor codes."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    ip.run_cell_magic("elastic", f"--nproc 1 --text --log-dir {log_dir}",
                      "import os\n"
                      "print(f'\\x1b[31m{os.environ[\"FORCE_COLOR\"]}\\x1b[0m\\x1b[?25h')")
    out = capsys.readouterr().out
    assert "[rank 0] \x1b[31m1\x1b[0m\n" in out and "\x1b[?25h" not in out


def memory_files() -> list[str]:
    """This process's descriptors of commits' memory files."""
    return [fd for fd in descriptors() if "elastic-snapshot" in fd]


def test_many_dashboard_cells_leave_no_widget_comm_or_result_behind(ip, log_dir, monkeypatch,
                                                                    capsys):
    """A notebook day: each finished cell's live widget is closed once its record is shown
    (the record is what stays), and the kernel keeps a bounded history for %elastic jobs.
    Each job's end frees what it held then, not when Python's cyclic collector next runs
    (which, in a kernel holding many objects, may be long after): the collector is off
    through the cells, so a job or a dashboard held in a reference cycle is still there,
    and so is its State's last commit, a memory file as large as the training state."""
    import gc

    from ipywidgets.widgets.widget import _instances

    from elastic_magic.notebook import job_commands
    from elastic_magic.result import JobResult

    published: list[dict] = []
    monkeypatch.setattr(ip, "kernel", object(), raising=False)  # a frontend with widgets
    monkeypatch.setattr(ip.display_pub, "publish",
                        lambda data, *args, **kwargs: published.append(data))
    monkeypatch.setattr(job_commands, "JOB_HISTORY", 10)

    def alive(kind: type) -> list:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, kind)]

    ip.run_cell_magic("elastic", f"--nproc 1 --log-dir {log_dir}", "print('warm')")
    # (this process's earlier tests' too, another file's say: held, so no id is reused)
    earlier = alive(JobResult)
    widgets, results, earlier_ids = len(_instances), len(earlier), {id(r) for r in earlier}
    snapshots = memory_files()
    gc.disable()
    try:
        for i in range(60):
            published.clear()
            value = ip.run_cell_magic(
                "elastic", f"--nproc 1 --log-dir {log_dir}",
                f"import elastic_magic\nelastic_magic.State(step={i}).commit()\n"
                f"print('cell {i}')\nb'x' * 100_000")
            records = [d for d in published if "elastic-record" in d.get("text/html", "")]
            assert len(records) == 1 and f"cell {i}" in records[0]["text/html"], published
        # Not collected: what a cycle holds is still listed.
        assert not [o for o in gc.get_objects() if isinstance(o, Dashboard)]
        assert len(memory_files()) <= len(snapshots) + 1  # the last job's, until it goes
    finally:
        gc.enable()
    assert len(_instances) <= widgets  # each dashboard and its layout closed
    assert not alive(Dashboard)
    del value
    kept = alive(JobResult)
    assert len(kept) <= results + 10  # the history's, no more (and the earlier ones)
    # The history keeps what %elastic shows, not the values: only the last job, not yet
    # moved into it, holds its own.
    assert len([r for r in kept if r.values and id(r) not in earlier_ids]) <= 1
    capsys.readouterr()
    ip.run_line_magic("elastic", "jobs")
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 10 and all("succeeded" in line for line in listed), listed
    number, run_id = listed[0].split()[:2]  # an ended job, as the history keeps it
    for command in ("status", "stop", "stacks", "logs 0"):
        ip.run_line_magic("elastic", f"{command} {number}")
    out = capsys.readouterr().out
    assert f"run_id: {run_id}" in out and f"{run_id} has already ended (succeeded)" in out
    assert "it kept no stacks" in out and "cell 50" in out


ORDERED = textwrap.dedent("""
    import sys
    for i in range(400):
        print(f"out {i}")
        if i % 40 == 39:
            print(f"err {i}", file=sys.stderr)
    raise ValueError("after the lines")
""")


def _ordered_lines() -> list[tuple[str, str]]:
    lines = []
    for i in range(400):
        lines.append(("stdout", f"out {i}"))
        if i % 40 == 39:
            lines.append(("stderr", f"err {i}"))
    return lines


def test_a_ranks_lines_keep_their_order_across_stdout_and_stderr(log_dir):
    """stdout and stderr reach the kernel through two pipes; a rank's lines still show in
    the order it wrote them (the widget, the record, --text), its traceback after them."""
    buffer = io.StringIO()
    text = TextRenderer(stdout=buffer, stderr=buffer, status=False)
    spec = JobSpec.create(nproc=1, log_dir=log_dir)
    job = Job(spec, build_payload(ORDERED, spec)).start()
    view = LiveView(job)
    try:
        job.wait(lambda events: (view(events), text(events)))
    finally:
        view.finish()
    expected = _ordered_lines()
    shown = view.state.shown_lines(0)  # the traceback is in the root cause: one line here
    assert len(shown) > 100 and shown == [*expected[-(len(shown) - 1):],
                                          ("stderr", TRACEBACK_SHOWN)]
    assert [line[1:] for line in view.widget.lines["0"]] == [[t] for _, t in shown]
    record = record_bundle(view.state)["text/plain"]
    rank_lines = [line.removeprefix("[rank 0] ") for line in record.splitlines()
                  if line.startswith("[rank 0] ")]
    assert rank_lines == [t for _, t in shown]
    printed = [line.removeprefix("[rank 0] ") for line in buffer.getvalue().splitlines()]
    trace = printed.index("Traceback (most recent call last):")
    assert printed[:trace] == [t for _, t in expected]
    assert printed[-1] == "ValueError: after the lines"
    # The logs are each stream's bytes, as written: the order marks are not in them.
    assert job.result.log_path(0).read_text() == "".join(
        f"{t}\n" for s, t in expected if s == "stdout")
    stderr = job.result.log_path(0, "stderr").read_text()
    assert stderr.startswith("".join(f"{t}\n" for s, t in expected if s == "stderr")
                             + "Traceback (most recent call last):\n")
    assert "\x00" not in stderr


@pytest.mark.unit
def test_order_marks_are_found_wherever_reads_cut_them():
    from elastic_magic.agent.node.output import _Marks
    from elastic_magic.worker.stdout import ORDER_END, order_mark

    mark, end = order_mark("ab" * 16).encode(), ORDER_END.encode()
    not_ours = (mark + b"x" + end  # the same start, no number: plain bytes
                + order_mark("cd" * 16).encode() + b"5" + end  # another nonce
                + b"\x00elastic-magic-order:7" + end)  # the mark without a nonce
    data = b"a\n" + mark + b"3" + end + b"b\n" + mark + b"12" + end + b"c\x00" + not_ours + b"d\x00"
    for size in (1, 2, 7, len(data)):
        marks, pieces = _Marks(mark), []
        for at in range(0, len(data), size):
            pieces += marks.split(data[at:at + size])
        pieces.append((marks.order, marks.rest()))
        joined: dict[int, bytes] = {}
        for order, piece in pieces:
            joined[order] = joined.get(order, b"") + piece
        assert joined == {0: b"a\n", 3: b"b\n", 12: b"c\x00" + not_ours + b"d\x00"}


FORGED = textwrap.dedent("""
    import sys
    print("epoch 1")
    print("record \\x00elastic-magic-order:99999999\\x00 from a dataset")
    print("guessed \\x00elastic-magic-order:" + "0" * 32 + ":99999999\\x00 nonce")
    print("epoch 2")
    print("ValueError at epoch 2", file=sys.stderr)
""")
FORGED_LINES = ["epoch 1", "record \x00elastic-magic-order:99999999\x00 from a dataset",
                "guessed \x00elastic-magic-order:" + "0" * 32 + ":99999999\x00 nonce",
                "epoch 2"]


def test_text_that_looks_like_an_order_mark_is_printed_text(log_dir, recorder):
    """A cell that prints an order mark's bytes (without the rank's nonce, or with a
    guessed one) neither reorders its lines nor loses those bytes: the record and the logs
    hold them as printed, the error after the lines before it."""
    spec = JobSpec.create(nproc=1, log_dir=log_dir)
    job = Job(spec, build_payload(FORGED, spec)).start()
    result = job.wait(recorder)
    assert result.ok
    from elastic_magic.wire.events import Output

    shown = [(e.stream, line) for e in recorder.of(Output) if e.rank == 0 for line in e.lines]
    assert shown == [*(("stdout", line) for line in FORGED_LINES),
                     ("stderr", "ValueError at epoch 2")]
    assert result.log_path(0).read_text() == "".join(f"{line}\n" for line in FORGED_LINES)
    assert result.log_path(0, "stderr").read_text() == "ValueError at epoch 2\n"


def test_what_a_forked_child_prints_is_kept_unbuffered_and_unmarked(log_dir, recorder):
    """A child forked by the cell (DataLoader workers) writes without order marks, and its
    stderr is unbuffered as the rank's is: a child that leaves with os._exit loses none."""
    cell = textwrap.dedent("""
        import os, sys
        print("parent"); print("parent err", file=sys.stderr)
        if (pid := os.fork()) == 0:
            print("child"); print("child err", file=sys.stderr)
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent again")
    """)
    spec = JobSpec.create(nproc=1, log_dir=log_dir)
    job = Job(spec, build_payload(cell, spec)).start()
    result = job.wait(recorder)
    assert result.ok
    assert recorder.lines(0) == ["parent", "child", "parent again"]
    assert recorder.lines(0, "stderr") == ["parent err", "child err"]
    assert result.log_path(0).read_text() == "parent\nchild\nparent again\n"
    assert result.log_path(0, "stderr").read_text() == "parent err\nchild err\n"
