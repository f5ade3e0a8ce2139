"""Sessions: real workers that keep their namespaces across cells and survive failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from conftest import KILL_OWN_SHEPHERD, tagged_workers, wait_for_workers

import elastic_magic as em
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.ui.describe import duration
from elastic_magic.ui.record import summary_line
from elastic_magic.wire.events import Output, SessionBroken, SessionReformed, WorkerFailed
from elastic_magic.wire.payload import PayloadError


class Watcher:
    """A renderer that keeps every event and can wait for a line of output."""

    def __init__(self) -> None:
        self.events: list = []
        self.seen = threading.Condition()

    def __call__(self, events: list) -> None:
        with self.seen:
            self.events.extend(events)
            self.seen.notify_all()

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def wait_for_lines(self, text: str, count: int, timeout: float = 60) -> bool:
        def found() -> bool:
            return sum(text in line for e in self.of(Output) for line in e.lines) >= count
        with self.seen:
            return self.seen.wait_for(found, timeout)


def run_in_thread(session: em.Session, source: str, watcher: Watcher) -> dict:
    """Run a cell from another thread (the test's thread interrupts it)."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = session.run(source, render=watcher, check=False)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    box["thread"] = threading.Thread(target=target, daemon=True)
    box["thread"].start()
    return box


def _wakeups(pid: int, tids: set[int]) -> dict[int, int]:
    """Times each of these threads of ``pid`` blocked again after running (voluntary
    switches), for those that still run."""
    counts = {}
    for tid in tids:
        try:  # gone: a thread object copied by a fork, or a thread that has ended
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                counts[tid] = sum(int(line.split()[1]) for line in f
                                  if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return counts


def assert_idle_costs_nothing(session: em.Session) -> None:
    """Between cells our threads sleep until woken, in the kernel and in the workers (not
    gloo's own TCP loop, nor torch's rendezvous keep-alive timer). A thread that ends
    meanwhile is not counted: the kernel's "elastic" threads include an earlier test's
    ending in this process (one that closes a rendezvous, say); it once made the sum
    drop by its switches (a full run: -28)."""
    session.run("import os, threading\n"
                "_ours = (os.getpid(), {t.native_id for t in threading.enumerate()})")
    workers = list(session.gather("_ours").values())
    kernel = {t.native_id for t in threading.enumerate() if t.name.startswith("elastic")}
    places = [*workers, (os.getpid(), kernel)]
    time.sleep(0.5)  # the last cell's reports and output settle
    before = [_wakeups(pid, tids) for pid, tids in places]
    time.sleep(2.0)
    after = [_wakeups(pid, tids) for pid, tids in places]
    woken = [{t: a[t] - b[t] for t in a.keys() & b.keys() if a[t] != b[t]}
             for b, a in zip(before, after, strict=True)]
    assert woken == [{}] * len(places), (places, woken)


def test_a_session_keeps_values_reports_failures_moves_variables_and_survives_ctrl_c(log_dir):
    with em.Session(nproc=2, log_dir=log_dir) as s:
        # Three cells, one namespace per rank: a tensor made in the first is there later.
        s.run("import torch, torch.distributed as dist\n"
              "t = torch.ones(2) * (dist.get_rank() + 1)\n", setup=True)
        assert s.run("dist.all_reduce(t)\nt.tolist()").values == {0: [3.0, 3.0],
                                                                   1: [3.0, 3.0]}
        pids = s.status()["pids"]
        assert s.run("t.sum().item()").values == {0: 6.0, 1: 6.0}
        assert_idle_costs_nothing(s)

        # A rank that raises: the cell reports it, the session goes on with the same ranks.
        with pytest.raises(em.JobFailedError) as err:
            s.run("if dist.get_rank() == 1:\n    raise ValueError('rank 1 says no')\n'ok'")
        assert err.value.result.failure.rank == 1
        assert "ValueError: rank 1 says no" in err.value.result.failure.headline
        assert s.run("t[0].item()").values == {0: 3.0, 1: 3.0}

        # Variables both ways, with clear errors for what cannot travel or is not there.
        s.push(scale=10, fn=lambda v: v * 2)
        assert s.run("fn(scale)").values == {0: 20, 1: 20}
        assert s.gather("scale") == {0: 10, 1: 10}
        assert s.run("rank_value = dist.get_rank() * 5").ok
        assert s.pull("rank_value", rank=1) == 5
        with pytest.raises(PayloadError, match="lock"):
            s.push(lock=threading.Lock())
        cells = s.cells
        with pytest.raises(ValueError, match="'not a name' is not a variable name"):
            s.push(**{"not a name": 1})
        assert s.cells == cells  # refused before anything was sent
        with pytest.raises(NameError, match="no variable named 'nothing_here'"):
            s.pull("nothing_here")
        s.run("import threading\nheld = threading.Lock()")
        with pytest.raises(PayloadError, match="cannot travel back"):
            s.pull("held")

        # Ctrl-C (SIGINT to the kernel's main thread, which waits for the cell):
        # KeyboardInterrupt in every rank's running code; the ranks come back.
        watcher = Watcher()
        main = threading.main_thread().ident

        def ctrl_c_once_running() -> None:
            if watcher.wait_for_lines("sleeping", 2):
                signal.pthread_kill(main, signal.SIGINT)

        threading.Thread(target=ctrl_c_once_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            s.run("import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n",
                  render=watcher)
        assert {e.failure.exc_type for e in watcher.of(WorkerFailed)} == {"KeyboardInterrupt"}
        assert len(watcher.of(WorkerFailed)) == 2  # every rank's running code
        assert s.run("t[0].item()").values == {0: 3.0, 1: 3.0}  # the namespace survived
        assert s.status()["pids"] == pids and s.status()["restarts"] == "0/3"

        # A rank that does not come back within the grace period: re-formed, told so.
        watcher = Watcher()
        box = run_in_thread(s, "import time\nprint('busy', flush=True)\n"
                               "while True:\n"
                               "    try:\n"
                               "        time.sleep(120)\n"
                               "    except KeyboardInterrupt:\n"
                               "        if dist.get_rank() == 0:\n"
                               "            break\n", watcher)
        assert watcher.wait_for_lines("busy", 2)
        s.interrupt()
        box["thread"].join(60)
        broken = watcher.of(SessionBroken)
        assert broken and "rank 1 did not come back" in broken[0].reason and broken[0].reforms
        # Interrupted, not succeeded with rank 0's value: the group it ran on is gone.
        result = box["result"]
        assert result.state is em.JobState.STOPPED and result.values == {}
        assert result.stop_reason == ("interrupted: rank 1 did not come back within 5s of "
                                      "the interrupt")
        watcher = Watcher()
        assert s.run("t.tolist()", render=watcher).values == {0: [1.0, 1.0], 1: [2.0, 2.0]}
        assert watcher.of(SessionReformed)[0].setup_cells == 1
        assert s.status()["restarts"] == "1/3"
    assert s.result.state is em.JobState.STOPPED
    assert not tagged_workers()
    with pytest.raises(em.SessionEndedError):
        s.run("1")


def test_a_cell_whose_group_broke_fails_or_is_interrupted_naming_the_rank(log_dir):
    """A group that breaks in a cell never makes the cell succeed with whatever values
    came: a rank that exits (with code 0 too), loses its shepherd, or does not come back
    from an interrupt is named. Each break re-forms the session."""
    with em.Session(nproc=2, max_restarts=5, log_dir=log_dir) as s:
        s.run("import os, time, torch, torch.distributed as dist", setup=True)

        watcher = Watcher()
        result = s.run("if dist.get_rank() == 1:\n    os._exit(0)\ntime.sleep(120)\n",
                       render=watcher, check=False)
        assert result.state is em.JobState.FAILED and result.values == {}
        assert [(f.rank, f.exit_code, f.headline) for f in result.failures] == [
            (1, 0, "exited with code 0 in the middle of the cell")]
        assert [b.reason for b in watcher.of(SessionBroken)] == [
            "rank 1 exited with code 0 in the middle of the cell"]

        # The shepherd's exit comes first, the worker's pipe closes after the teardown:
        # the rank died before the teardown, it was not stopped by it.
        for _ in range(3):
            watcher = Watcher()
            with pytest.raises(em.JobFailedError) as err:
                s.run(KILL_OWN_SHEPHERD, render=watcher)
            result = err.value.result
            assert result.values == {}
            assert [(f.rank, f.signal) for f in result.failures] == [(1, "SIGKILL")]
            assert str(err.value).startswith("Rank 1 failed first")
            assert [b.reason for b in watcher.of(SessionBroken)] == [
                "rank 1 was killed by SIGKILL in the cell"]

        # Rank 1 returned while rank 0 waits in a collective for it; an interrupt cannot
        # reach rank 0 there: the cell was interrupted, naming rank 0, not succeeded.
        watcher = Watcher()
        box = run_in_thread(s, "t = torch.ones(1)\n"
                               "if dist.get_rank() == 0:\n"
                               "    dist.all_reduce(t)\n"
                               "'done'", watcher)
        # Seen there twice, half a second apart: in the C++ wait, not in the Python code
        # around it (where an interrupt would still be taken).
        stacks: dict[int, str] = {}
        deadline, waiting_since = time.monotonic() + 60, None
        while time.monotonic() < deadline:
            stacks = s.stacks()
            if not ("all_reduce" in stacks.get(0, "") and "finished" in stacks.get(1, "")):
                waiting_since = None
            elif waiting_since is None:
                waiting_since = time.monotonic()
            elif time.monotonic() - waiting_since > 0.5:
                break
        s.interrupt()
        box["thread"].join(60)
        result = box["result"]
        assert result.state is em.JobState.STOPPED and result.values == {}, stacks
        assert result.stop_reason == ("interrupted: rank 0 did not come back within 5s of "
                                      "the interrupt")
        assert [(e.failure.rank, e.failure.headline) for e in watcher.of(WorkerFailed)] == [
            (0, "did not come back within 5s of the interrupt")]

        assert s.run("dist.get_world_size()").values == {0: 2, 1: 2}
        assert s.status()["restarts"] == "5/5"
    assert not tagged_workers()


STALL = """t = torch.ones(1)
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(120)
dist.all_reduce(t)
"""  # rank 1 sleeps outside any collective; rank 0 waits for it in all_reduce


def test_the_stall_watchdog_fails_a_session_cell_naming_the_stalled_rank(log_dir):
    """--stall-timeout in a session: a rank quiet outside any collective breaks the group
    as a death does; the cell fails naming it (its stack kept), the rank that waited for it
    is a consequence, and the session re-forms. Time between cells is not a stall."""
    with em.Session(nproc=2, stall_timeout=3, timeout=60, max_restarts=1,
                    log_dir=log_dir) as s:
        s.run("import time, torch, torch.distributed as dist", setup=True)
        time.sleep(4)  # idle longer than the stall timeout
        assert s.run("dist.all_reduce(torch.ones(1)); 'fine'").values == {0: "fine",
                                                                           1: "fine"}
        watcher = Watcher()
        result = s.run(STALL, render=watcher, check=False)
        assert result.state is em.JobState.FAILED and result.values == {}
        root = result.failure
        assert root.rank == 1 and root.reason.startswith("stalled: no progress for"), root
        assert "outside any collective" in root.reason and "time.sleep(120)" in root.traceback
        (waiting,) = [f for f in result.failures if f.rank == 0]
        assert waiting.consequence and waiting.reason == "waited in all_reduce"
        assert "dist.all_reduce(t)" in result.stacks[0] and "time.sleep" in result.stacks[1]
        assert result.duration < 45, "the watchdog, not the 60 s collective timeout, ended it"
        assert [b.reason for b in watcher.of(SessionBroken)] == ["rank 1 stalled in the cell"]
        assert s.run("dist.get_world_size()").values == {0: 2, 1: 2}  # re-formed
        assert s.status()["restarts"] == "1/1"
    assert not tagged_workers()


def _worker_pids(session: em.Session) -> dict[int, int]:
    return session.gather("my_pid")


class Board(Watcher):
    """A watcher that also keeps what the cell's dashboard shows (its ``finish`` makes
    the session send the cell's JobFinished, as to a LiveView)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = DashboardState("em-test", "/nonexistent", 1)

    def __call__(self, events: list) -> None:
        for event in events:
            self.state.apply(event)
        super().__call__(events)

    def finish(self) -> None:
        pass


def test_a_killed_rank_is_replaced_setup_cells_replayed_and_state_restored(log_dir):
    with em.Session(nproc=2, max_restarts=1, log_dir=log_dir) as s:
        s.run("import os, torch, elastic_magic as em\n"
              "model = torch.nn.Linear(2, 2)\n"
              "state = em.State(model=model, step=0)\n", setup=True)
        s.run("offset = 100\nmy_pid = os.getpid()\n", setup=True)
        s.run("for _ in range(3):\n"
              "    state.step += 1\n"
              "    state.commit()\n"
              "leftover = 'not replayed'\n")  # not a setup cell
        before = _worker_pids(s)
        with pytest.raises(em.JobFailedError, match="NameError"):  # an error of the cell's
            s.run("if int(os.environ['RANK']) == 1:\n    undefined_name\n")
        os.kill(before[1], signal.SIGKILL)  # between cells
        deadline = time.monotonic() + 60
        while s.status()["restarts"] != "1/1" and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # idle after the break: not the next cell's time
        watcher = Board()
        submitted = time.time()
        result = s.run("(state.step + offset, 'leftover' in globals())", render=watcher)
        assert result.values == {0: (103, False), 1: (103, False)}
        assert result.restarts == 1
        # The cell's header, record and timeline give the cell's own time, the same one.
        header = watcher.state.header
        assert submitted <= header["started_at"] == result.started
        assert header["finished_at"] == result.started + result.duration
        shown = duration(result.duration)
        assert summary_line(watcher.state).endswith(f" · {shown}")
        assert f"{result.duration:.1f}s" == shown
        assert any(shown in e["text"] for e in watcher.state.timeline
                   if e["kind"] == "succeeded")
        reformed = watcher.of(SessionReformed)
        assert [(r.setup_cells, r.step, r.world_size) for r in reformed] == [(2, 3, 2)]
        # Why: the kill, not the error that rank's last cell raised.
        assert [b.reason for b in watcher.of(SessionBroken)] == [
            "rank 1 was killed by SIGKILL while the session was idle"]
        after = _worker_pids(s)
        assert not set(after.values()) & set(before.values())
        assert not psutil.pid_exists(before[1]) or \
            psutil.Process(before[1]).status() == psutil.STATUS_ZOMBIE

        # --max-restarts bounds re-formations: the next death ends the session.
        watcher = Watcher()
        with pytest.raises(em.JobFailedError) as err:
            s.run("if dist_rank := int(os.environ['RANK']):\n    os._exit(3)\n"
                  "import time\ntime.sleep(60)\n", render=watcher)
        assert err.value.result.failure.rank == 1 and err.value.result.failure.exit_code == 3
        assert [b.reforms for b in watcher.of(SessionBroken)] == [False]
        s.stop()
        assert s.result.state is em.JobState.FAILED
    with pytest.raises(em.SessionEndedError):
        s.run("1")
    assert not tagged_workers()


def test_resize_between_cells_and_at_a_commit_keeps_state(log_dir):
    with em.Session(nproc=2, max_nproc=3, log_dir=log_dir) as s:
        s.run("import torch.distributed as dist, elastic_magic as em\n"
              "state = em.State(step=0)\n", setup=True)
        s.run("state.step = 5\nstate.commit()")
        s.scale(3)
        result = s.run("(state.step, dist.get_world_size())")
        assert result.values == {r: (5, 3) for r in range(3)}
        assert result.restarts == 0 and result.resizes == 1

        # At a commit inside a running cell: every rank leaves there, the session re-forms
        # at the new size and the cell goes on from that commit.
        watcher = Watcher()
        box = run_in_thread(s, "import time\n"
                               "while state.step < 40:\n"
                               "    state.step += 1\n"
                               "    print('step', state.step, flush=True)\n"
                               "    state.commit()\n"
                               "    time.sleep(0.05)\n"
                               "(state.step, dist.get_world_size())", watcher)
        assert watcher.wait_for_lines("step", 3)
        s.scale(2)
        box["thread"].join(120)
        result = box["result"]
        assert result.values == {0: (40, 2), 1: (40, 2)}, (
            result.state, result.failure, result.stop_reason,
            "\n".join(repr(e) for e in watcher.events if not isinstance(e, Output)))
        assert result.restarts == 0 and result.resizes == 2
        assert watcher.of(SessionReformed)[0].world_size == 2


def test_ctrl_c_while_the_session_waits_for_machines_ends_it(log_dir):
    watcher = Watcher()
    s = em.Session(nproc=1, nnodes=2, log_dir=log_dir, timeout=120)
    assert s.wait_for_join_command(timeout=60)
    box = run_in_thread(s, "1", watcher)  # waits for the second machine, which never comes
    time.sleep(0.5)
    s.interrupt()
    box["thread"].join(60)
    assert isinstance(box.get("error"), em.SessionEndedError) or \
        box["result"].state is em.JobState.STOPPED, box
    s.stop(timeout=60)
    assert not s.active and s.result.state is em.JobState.STOPPED


def test_bad_session_options_are_errors_before_anything_starts(log_dir):
    with pytest.raises(em.SpecError, match="--max-nproc"):
        em.Session(nproc=2, max_nproc=1, log_dir=log_dir)
    with pytest.raises(TypeError, match="unknown job option"):
        em.Session(nproc=1, nprocs=2)
    assert not tagged_workers()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# Rank 0 is held after it has the next cell's Run, before it begins the cell: where it
# enters the cell's folder (``os.chdir``, an audit event), until its listener has taken
# the Interrupt.
HOLD_RANK_0 = """import os, pathlib, sys, time
def _hold_once(event, args, armed=[1] if os.environ["RANK"] == "0" else []):
    if event == "os.chdir" and armed:
        armed.clear()
        pathlib.Path(args[0], "preparing-0").touch()
        leave = sys.modules["elastic_magic.worker.leave"]
        deadline = time.monotonic() + 60
        while not leave.asked() and time.monotonic() < deadline:
            time.sleep(0.02)
sys.addaudithook(_hold_once)
"""

INTERRUPTED_CELL = """pathlib.Path(f"began-{os.environ['RANK']}").touch()
try:
    time.sleep(120)
except KeyboardInterrupt:
    pathlib.Path(f"interrupted-{os.environ['RANK']}").touch()
    raise
"""


def interrupt_before_rank_0_begins(ip, folder, monkeypatch) -> None:
    """Ctrl-C while rank 1 runs the cell and rank 0 has its Run but has not begun it:
    rank 0 is interrupted as it begins (the cell's code never runs there), every rank is
    back at once and the session goes on with the same processes."""
    monkeypatch.chdir(folder)
    ip.run_cell_magic("elastic", "", HOLD_RANK_0)
    session = ip.find_line_magic("elastic").__self__.sessions.session
    pids = session.status()["pids"]
    main = threading.main_thread().ident

    late: list[str] = []

    def ctrl_c_once_rank_0_is_held() -> None:
        deadline = time.monotonic() + 60
        while not ((folder / "preparing-0").exists() and (folder / "began-1").exists()):
            if time.monotonic() > deadline:
                late.append(f"not held in time: {sorted(p.name for p in folder.iterdir())}")
                break
            time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=ctrl_c_once_rank_0_is_held, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("elastic", "", INTERRUPTED_CELL)
    assert not late
    assert (folder / "interrupted-1").exists() and not (folder / "began-0").exists()
    assert session.status()["pids"] == pids  # back within the grace: not re-formed
    assert ip.run_cell_magic("elastic", "", "os.getpid()").values == pids


def test_session_magics_run_cells_in_the_session_and_hold_nothing_per_cell(ip, log_dir,
                                                                           capsys, tmp_path,
                                                                           monkeypatch):
    from IPython.core.error import UsageError

    ip.run_line_magic("elastic", f"session start --nproc 2 --log-dir {log_dir}")
    assert "session of 2 workers" in capsys.readouterr().out
    with pytest.raises(UsageError, match="already active"):
        ip.run_line_magic("elastic", "session start --nproc 1")
    ip.run_cell_magic("elastic", "--setup", "import torch.distributed as dist\n"
                                            "w = [dist.get_rank()]\nprint('made w')\n")
    assert "[rank 1] made w" in capsys.readouterr().out
    ip.run_cell("factor = 3")
    assert ip.run_line_magic("elastic", "push factor") is None
    result = ip.run_cell_magic("elastic", "-o cell", "w.append(factor)\nw")
    assert result.values == {0: [0, 3], 1: [1, 3]} and ip.user_ns["cell"] is result
    assert ip.run_line_magic("elastic", "pull w --rank 1") == [1, 3]
    ip.run_line_magic("elastic", "gather factor")
    assert ip.user_ns["w"] == [1, 3] and ip.user_ns["factor"] == {0: 3, 1: 3}
    # As the docs write it: the value is the magic's, not only the kernel variable's.
    ip.run_cell("factors = %elastic gather factor\n"
                "both = %elastic pull w factor").raise_error()
    assert ip.user_ns["factors"] == {0: 3, 1: 3}
    assert ip.user_ns["both"] == ([0, 3], 3)
    with pytest.raises(em.JobFailedError):
        ip.run_cell_magic("elastic", "", "w[5]")
    with pytest.raises(UsageError, match="take no job options"):
        ip.run_cell_magic("elastic", "--nproc 4", "1")
    with pytest.raises(UsageError, match="IPython syntax"):
        ip.run_cell_magic("elastic", "", "!ls")
    interrupt_before_rank_0_begins(ip, tmp_path, monkeypatch)

    # Many cells: the kernel's threads and files stay as they were.
    for _ in range(5):
        ip.run_cell_magic("elastic", "", "x = 1")
    threads, fds = threading.active_count(), _open_fds()
    for i in range(50):
        ip.run_cell_magic("elastic", "", f"x = {i}")
    assert threading.active_count() <= threads and _open_fds() <= fds
    assert ip.run_cell_magic("elastic", "", "x").values == {0: 49, 1: 49}
    capsys.readouterr()
    ip.run_line_magic("elastic", "session status")
    assert "cells:" in capsys.readouterr().out
    ip.run_line_magic("elastic", "stacks")  # idle ranks: their main threads wait for a cell
    out = capsys.readouterr().out
    assert "==> rank 0 <==" in out and "==> rank 1 <==" in out
    ip.run_line_magic("elastic", "logs 1 -n 100")  # the session's own logs, as a job's
    out = capsys.readouterr().out
    session = ip.find_line_magic("elastic").__self__.sessions.session
    assert f"{session.run_id}/group_0/rank_1/stdout.log <==" in out and "made w" in out

    ip.run_line_magic("elastic", "session stop")
    with pytest.raises(UsageError, match="no session is active"):
        ip.run_line_magic("elastic", "session stop")
    ip.run_line_magic("elastic", f"session start --nproc 1 --log-dir {log_dir}")

    # The extension unloaded: the session ends with it.
    session = ip.find_line_magic("elastic").__self__.sessions.session
    ip.run_line_magic("unload_ext", "elastic_magic")
    assert not session.active and not tagged_workers()
    ip.run_line_magic("load_ext", "elastic_magic")
    with pytest.raises(UsageError, match="no session is active"):
        ip.run_cell_magic("elastic", "--setup", "1")


def test_in_a_real_kernel_ctrl_c_leaves_the_session_alive_and_it_ends_with_the_kernel():
    from conftest import wait_until_no_workers
    from jupyter_client.manager import start_new_kernel
    from test_kernel import execute

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        execute(kc, "%load_ext elastic_magic\n%elastic session start --nproc 2")
        reply, before = execute(kc, "%%elastic --text\nimport os, time\n"
                                    "print('waiting', flush=True)\ntime.sleep(120)\n",
                                trigger="[rank 1] waiting", action=km.interrupt_kernel)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", before
        assert "KeyboardInterrupt" in before
        # Its own import: if the session re-formed, what the interrupted cell defined went
        # with it (a rank that had not begun the cell when the interrupt came ran it on).
        reply, text = execute(kc, "%%elastic --text\nimport os\n"
                                  "print('still here', os.getpid())")
        # (the interrupted cell's lines too: a rank not back within the grace re-forms)
        assert reply["status"] == "ok" and "[rank 1] still here" in text, before + text
        assert len(wait_for_workers(2)) == 2
        km.shutdown_kernel(now=False)
        left = wait_until_no_workers(timeout=5.0)
        assert not left, f"workers outlived the kernel: {[p.pid for p in left]}"
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


# The end-of-cell mark before it carried the rank's nonce: text any cell can print.
OLD_END_MARK = "\x00elastic-magic-cell-end\x00"


@pytest.mark.unit
def test_end_of_cell_marks_leave_the_cells_own_lines_whole(tmp_path):
    """The pump takes a rank's nonced end mark as the end of its cell's output on that
    stream, after the line it ends (one without a newline is still a line), and keeps it
    out of the logs; the old mark's text, or a mark with another nonce, is printed text."""
    from elastic_magic.agent.inbox import OutputEnded
    from elastic_magic.agent.loop.cells import take_end_marks
    from elastic_magic.agent.node.output import RankPump, new_tail
    from elastic_magic.worker.stdout import cell_end_mark

    nonce = "ab" * 16
    end, forged = cell_end_mark(nonce).encode(), cell_end_mark("cd" * 16).encode()
    printed = {"stdout": b"a\n\n" + OLD_END_MARK.encode() + b"\n" + forged + b"\npartial",
               "stderr": b""}
    pipes = {name: os.pipe() for name in printed}
    for name, (_, write) in pipes.items():
        os.write(write, printed[name] + end + (b"next\n" if name == "stdout" else b""))
        os.close(write)
    logs = {name: os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT) for name in pipes}
    events: list = []
    pump = RankPump({name: read for name, (read, _) in pipes.items()}, logs, rank=1,
                    attempt=0, emit=events.append, tail=new_tail(), nonce=nonce)
    pump.start()
    pump.join(timeout=30)
    ended: list = []
    shown = {"stdout": [], "stderr": []}
    for event in events:
        kept = take_end_marks(event, ended.append)
        shown[event.stream] += [*(kept.lines if kept else ()), *(["END"] * event.cell_end)]
        assert kept is None or not kept.cell_end  # never taken as an end twice
    assert shown == {"stdout": ["a", "", OLD_END_MARK, forged.decode(), "partial", "END",
                                "next"],
                     "stderr": ["END"]}
    assert sorted(ended, key=str) == [OutputEnded(0, 1, "stderr"), OutputEnded(0, 1, "stdout")]
    assert (tmp_path / "stdout").read_bytes() == printed["stdout"] + b"next\n"
    assert (tmp_path / "stderr").read_bytes() == b""


def test_a_cell_that_prints_the_end_marks_text_keeps_all_its_lines(log_dir):
    """A cell whose output holds what the end-of-cell mark used to be (a log replayed, a
    dataset record), on both streams, followed by many lines: every line shows under that
    cell, the old mark's text included, and none under the next cell."""
    cell = ("import sys\nprint('before')\n"
            f"print({OLD_END_MARK!r})\nprint({OLD_END_MARK!r}, file=sys.stderr)\n"
            "for i in range(3000):\n    print(f'line {i}')\nprint('FINAL LOSS 0.25')\n")
    expected = ["before", OLD_END_MARK, *(f"line {i}" for i in range(3000)),
                "FINAL LOSS 0.25"]
    with em.Session(nproc=1, log_dir=log_dir) as s:
        first, second = Watcher(), Watcher()
        assert s.run(cell, render=first).ok
        assert s.run("print('the next cell')", render=second).ok
    shown = {stream: [line for e in first.of(Output) if e.stream == stream for line in e.lines]
             for stream in ("stdout", "stderr")}
    assert shown == {"stdout": expected, "stderr": [OLD_END_MARK]}
    assert [line for e in second.of(Output) for line in e.lines] == ["the next cell"]


def test_a_session_cells_lines_keep_their_order_across_stdout_and_stderr(log_dir):
    """In a session too (its traceback is written as the cell fails, and the worker goes
    on): the lines a rank printed come before its traceback, cell after cell."""
    cell = ("import sys\nfor i in range(300):\n    print(f'out {i}')\n"
            "    if i % 100 == 99:\n        print(f'err {i}', file=sys.stderr)\n"
            "raise ValueError('after the lines')\n")
    expected = [line for i in range(300)
                for line in [("stdout", f"out {i}")] + ([("stderr", f"err {i}")]
                                                        if i % 100 == 99 else [])]
    with em.Session(nproc=1, log_dir=log_dir) as s:
        for _ in range(2):
            watcher = Watcher()
            with pytest.raises(em.JobFailedError):
                s.run(cell, render=watcher)
            shown = [(e.stream, line) for e in watcher.of(Output) for line in e.lines]
            trace = shown.index(("stderr", "Traceback (most recent call last):"))
            assert shown[:trace] == expected
            assert shown[-1] == ("stderr", "ValueError: after the lines")
