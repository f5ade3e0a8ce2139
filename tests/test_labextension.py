"""The JupyterLab extension's TypeScript unit tests (jest, in labextension/), and the
kernel side of its comm (elastic_magic/notebook/comm.py) with a real job."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from elastic_magic.agent.handles.ended import EndedJob
from elastic_magic.agent.handles.job import Job
from elastic_magic.notebook import comm as comm_module
from elastic_magic.notebook.comm import JobsChannel, ListedJob
from elastic_magic.notebook.session import Session
from elastic_magic.spec import JobSpec
from elastic_magic.ui.dashboard import PanelView
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.wire.payload import build_payload

LABEXTENSION = Path(__file__).resolve().parents[1] / "labextension"


def test_typescript_unit_tests():
    """`jlpm test` where the extension's npm packages are installed (pip install -e . does
    that); CI must have them."""
    # jlpm comes with jupyter-builder, beside this interpreter (a venv need not be active)
    jlpm = shutil.which("jlpm", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                      os.environ.get("PATH", "")]))
    if jlpm is None or not (LABEXTENSION / "node_modules" / ".bin" / "jest").exists():
        reason = "labextension/node_modules is missing: pip install -e . (with node) installs it"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(reason)
        pytest.skip(reason)
    run = subprocess.run([jlpm, "test", "--ci"], cwd=LABEXTENSION, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr


class FakeComm:
    """The frontend's end of the comm: the one outside part of JobsChannel."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.on_message = None

    def send(self, message: dict) -> None:
        self.sent.append(message)

    def on_msg(self, callback) -> None:
        self.on_message = callback

    def on_close(self, _callback) -> None:
        pass


def test_comm_lists_a_job_and_stops_it(log_dir):
    spec = JobSpec.create(2, log_dir=log_dir, max_nproc=3)
    job = Job(spec, build_payload("import time\ntime.sleep(600)", spec)).start()
    channel = JobsChannel()
    comm = FakeComm()
    channel._attach(comm)
    view = PanelView(DashboardState(job.run_id, str(job.log_dir), 0), "model-1")
    try:
        channel.track(1, job, "cell-1", background=True, view=view)
        assert job.wait_for_running(timeout=120)
        channel.update()
        items = [m for m in comm.sent if m["type"] == "items"][-1]["items"]
        assert len(items) == 1
        row = items[0]
        assert row["id"] == job.run_id and row["state"] == "running"
        assert row["world_size"] == 2 and row["nproc"] == 2 and row["cell_id"] == "cell-1"
        assert row["can_resize"] and (row["min_nproc"], row["max_nproc"]) == (2, 3)
        assert row["widget"] == "model-1" and not row["has_record"]
        comm.on_message({"content": {"data": {"action": "record", "id": job.run_id}}})
        assert comm.sent[-1] == {"type": "error", "id": job.run_id,
                                 "text": f"{job.run_id} has no record (yet)"}
        # what the panel's buttons send, through the comm
        comm.on_message({"content": {"data": {"action": "scale", "id": job.run_id,
                                              "nproc": 7}}})
        assert "between 2 and 3" in comm.sent[-1]["text"]
        comm.on_message({"content": {"data": {"action": "stop", "id": job.run_id}}})
        assert job.wait_done(timeout=60)
    finally:
        job.end("test over")
        # what the view does when the cell's record replaces the widget
        view.freeze({"text/html": "<div class='elastic-record'>stopped</div>",
                     "text/plain": "stopped"})
    ticker = channel._ticker
    assert ticker is not None
    ticker.join(timeout=10)
    assert not ticker.is_alive()  # no thread outlives the jobs it reports
    finished = [m for m in comm.sent if m["type"] == "finished"]
    assert len(finished) == 1 and finished[0]["item"]["state"] == "stopped"
    last = [m for m in comm.sent if m["type"] == "items"][-1]["items"][0]
    assert last["done"] and last["elapsed"] == finished[0]["item"]["elapsed"]
    # The kernel's history keeps the ended job as an EndedJob: the panel lists the same row,
    # and its buttons answer without a job behind them.
    channel.forget([EndedJob.of(job)])
    assert channel.message()["items"] == [last]
    comm.on_message({"content": {"data": {"action": "scale", "id": job.run_id, "nproc": 3}}})
    assert comm.sent[-1] == {"type": "error", "id": job.run_id,
                             "text": f"{job.run_id} has already ended."}
    comm.on_message({"content": {"data": {"action": "stacks", "id": job.run_id}}})
    assert comm.sent[-1] == {"type": "stacks", "id": job.run_id, "ranks": {}}
    # A page reloaded before the end asks for the record that replaced the widget.
    assert last["has_record"] and last["widget"] == "model-1"
    comm.on_message({"content": {"data": {"action": "record", "id": job.run_id}}})
    assert comm.sent[-1] == {"type": "record", "id": job.run_id, "bundle": {
        "text/html": "<div class='elastic-record'>stopped</div>", "text/plain": "stopped"}}
    channel.forget([])
    assert channel.message()["items"] == []


def test_comm_lists_a_session_and_routes_its_actions(log_dir):
    """A real session in the panel: its row (kind, size, cells run, the cell that started
    it), and Stop, resize and stacks reach the session's own methods."""
    session = Session(nproc=2, max_nproc=3, log_dir=log_dir)
    channel = JobsChannel()
    comm = FakeComm()
    channel._attach(comm)
    try:
        channel.track_session(4, session, "cell-4")
        session.run("import time\nx = 1", render=lambda _events: None)
        channel.update()
        row = [m for m in comm.sent if m["type"] == "items"][-1]["items"][0]
        assert (row["kind"], row["id"], row["number"]) == ("session", session.run_id, 4)
        assert row["state"] == "idle" and row["world_size"] == 2 and row["cells"] == 1
        assert row["cell_id"] == "cell-4" and (row["min_nproc"], row["max_nproc"]) == (2, 3)
        idle_ticker = channel._ticker  # an idle session holds no thread: nothing to update
        assert idle_ticker is not None
        idle_ticker.join(timeout=10)
        assert not idle_ticker.is_alive()
        comm.on_message({"content": {"data": {"action": "scale", "id": session.run_id,
                                              "nproc": 9}}})
        assert comm.sent[-1]["type"] == "error" and "between 2 and 3" in comm.sent[-1]["text"]
        answered = threading.Event()
        comm.send = lambda m: (comm.sent.append(m),
                               m["type"] == "stacks" and answered.set())  # type: ignore
        comm.on_message({"content": {"data": {"action": "stacks", "id": session.run_id}}})
        assert answered.wait(60)
        stacks = [m for m in comm.sent if m["type"] == "stacks"][-1]
        assert stacks["id"] == session.run_id and sorted(stacks["ranks"]) == ["0", "1"]
        comm.on_message({"content": {"data": {"action": "stop", "id": session.run_id}}})
        session.stop(timeout=60)
        assert not session.active
    finally:
        session.stop(timeout=60)
    ticker = channel._ticker
    assert ticker is not None
    ticker.join(timeout=10)
    assert not ticker.is_alive()
    finished = [m for m in comm.sent if m["type"] == "finished"]
    assert len(finished) == 1 and finished[0]["item"]["kind"] == "session"
    assert finished[0]["item"]["done"]


def test_comm_lists_a_launcher_jobs_allocations(log_dir):
    """A job with --launcher: its row carries the allocations as its status has them (the
    panel shows those that wait with the scheduler's reason), and none once it ended."""
    spec = JobSpec.create(1, nnodes="1:2", launcher="local", log_dir=log_dir, timeout=60)
    job = Job(spec, build_payload("import time\ntime.sleep(600)", spec)).start()
    channel = JobsChannel()
    comm = FakeComm()
    channel._attach(comm)
    try:
        channel.track(1, job, None, background=True)
        job._board.wait_for(lambda s: s.nnodes == 2, timeout=120)
        channel.update()
        row = [m for m in comm.sent if m["type"] == "items"][-1]["items"][0]
        assert row["nnodes"] == 2
        assert row["machines"] == list(job.status_snapshot.machines) == \
            ["local1#1: running on local1"], row
        comm.on_message({"content": {"data": {"action": "stop", "id": job.run_id}}})
        assert job.wait_done(timeout=60)
    finally:
        job.end("test over")
    assert channel._ticker is not None
    channel._ticker.join(timeout=10)
    finished = [m for m in comm.sent if m["type"] == "finished"]
    assert len(finished) == 1 and finished[0]["item"]["machines"] == []


@pytest.mark.unit
def test_comm_offers_the_users_detached_jobs_that_this_kernel_does_not_follow(
        tmp_path, monkeypatch):
    """The panel's "Detached jobs" list: the user's live ones from the private runtime
    folder (never the token), less those this kernel follows; a job this kernel let go
    (Ctrl-C detaches) moves from its list there, with no "finished" message; one that ended
    here is not listed while its agent winds down."""
    from elastic_magic.agent.handles import detached_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = detached_folder.runtime_folder()
    started = psutil.Process().create_time()  # as an agent's: it began before it wrote
    for run_id in ("em-followed", "em-elsewhere", "em-let-go"):
        detached_folder.Connection(run_id, os.getpid(), str(folder), "secret-token", started,
                                   "%%elastic --detach --nproc 2").write(folder)
    detached_folder.Connection("em-killed", 2**22 - 1, str(folder), "t", started,
                               "%%elastic --detach").write(folder)  # no such process
    odd = folder / "em-odd.json"  # not an agent's: never listed, and it breaks nothing
    odd.write_text('{"run_id": "em-odd", "pid": 1, "folder": "/", "token": "t", '
                   '"started": "yesterday", "title": "?"}')
    odd.chmod(0o600)

    class Handle:  # what the channel reads of a followed or a let-go AttachedJob
        def __init__(self, run_id: str, done: bool, detached: bool,
                     link_lost: bool = False) -> None:
            self.run_id, self.done, self.detached = run_id, done, detached
            self.link_lost = link_lost

    channel = JobsChannel()
    comm = FakeComm()
    channel._attach(comm)
    listed = comm_module.detached_elsewhere({"em-followed"})
    assert [d["id"] for d in listed] == ["em-elsewhere", "em-let-go"]
    assert listed[0]["title"] == "%%elastic --detach --nproc 2"
    assert listed[0]["pid"] == os.getpid()
    assert 0 <= listed[0]["elapsed"] <= time.time() - started
    assert "secret-token" not in repr(listed)
    assert not (folder / "em-killed.json").exists()  # a killed agent's file is cleared
    # Followed: running; or told its end here (a result, or its agent's error) while its
    # agent winds down (its file is still there); not one whose link was lost, its agent
    # maybe running on.
    followed = [comm_module._followed(ListedJob(1, handle, None, True)) for handle in (
        Handle("em-followed", False, False), Handle("em-followed", True, False),
        Handle("em-followed", True, False, link_lost=True))]
    assert followed == [True, True, False]
    channel._items["em-let-go"] = ListedJob(2, Handle("em-let-go", True, True), None, True)
    channel.update()  # as the ticker does
    (message,) = comm.sent  # the list, and no "finished": the let-go job did not end
    assert message["items"] == [] and "em-let-go" not in channel._items
    assert [d["id"] for d in message["detached"]] == ["em-elsewhere", "em-followed",
                                                      "em-let-go"]
