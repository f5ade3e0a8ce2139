"""Launchers: the notebook starts its job's other machines through a scheduler and leaves
nothing behind. The SSH launcher runs the system's ssh against an OpenSSH server in each
network namespace (tests/netns.py, tests/sshd.py); Slurm's run in test_slurm.py."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import pytest
from netns import network as network  # the fixture
from sshd import start_sshd
from test_elastic import STEPS, TRAIN, assert_same_parameters, done_steps
from test_elastic import baseline as baseline  # the module-scoped fixture

import elastic_magic as em
from elastic_magic.agent.handles.job import AgentError, Job
from elastic_magic.checks import SpecError
from elastic_magic.folders import cache_folder
from elastic_magic.launchers import (
    CONFIG_VARIABLE,
    Allocation,
    JoinRequest,
    LauncherError,
    launcher_names,
    launcher_options,
    make_launcher,
)
from elastic_magic.launchers.cluster import Cluster
from elastic_magic.launchers.watchdog import Watchdog, lifeline
from elastic_magic.ui.dashboard_state import DashboardState
from elastic_magic.wire.events import MachinesChanged, NodeConnected, RendezvousCompleted
from elastic_magic.wire.payload import build_payload

PACKAGE_PARENT = str(Path(__file__).resolve().parents[1])


# -- options, before anything starts ---------------------------------------------------


@pytest.mark.unit
def test_options_come_from_the_config_file_and_flags_win(tmp_path, monkeypatch):
    config = tmp_path / "launchers.ini"
    config.write_text("[slurm]\npartition = debug\naccount = lab\n\n[ssh]\nhosts = a, b\n")
    monkeypatch.setenv(CONFIG_VARIABLE, str(config))
    spec = em.JobSpec.create(1, nnodes="1:3", launcher="slurm", launch=["account=other"])
    assert spec.launch == {"partition": "debug", "account": "other"}
    assert em.JobSpec.create(1, nnodes="1:3", launcher="ssh").launch == {"hosts": "a, b"}
    assert {"local", "slurm", "ssh"} <= set(launcher_names())


@pytest.mark.unit
@pytest.mark.parametrize(("options", "fragment"), [
    ({"launcher": "ssh", "launch": ["hosts=a"]}, "add --nnodes MIN:MAX"),
    ({"launcher": "ssh", "nnodes": "1:2"}, "needs hosts: --launch hosts="),
    ({"launcher": "pbs", "nnodes": "1:2"}, "no such launcher; the launchers are local, slurm"),
    ({"launch": ["hosts=a"], "nnodes": "1:2"}, "--launch is for a --launcher"),
    ({"launcher": "slurm", "nnodes": "1:2", "launch": ["partiton=x"]}, "no option 'partiton'"),
    ({"launcher": "slurm", "nnodes": "1:2", "launch": ["partition"]}, "write KEY=VALUE"),
])
def test_bad_launcher_options_say_what_to_do(options, fragment, tmp_path, monkeypatch):
    monkeypatch.setenv(CONFIG_VARIABLE, str(tmp_path / "none.ini"))
    with pytest.raises(SpecError, match=fragment):
        em.JobSpec.create(1, **options)


@pytest.mark.unit
def test_only_a_machine_the_head_let_in_waiting_for_a_round_regroups_the_job(log_dir):
    """torch's "a machine waits" signal, as the head reads it: a machine sent away (its
    allocation given back) joins torch's wait list as it says Hello, so it may be there
    after the head took it out; it is taken out again, and regroups nothing. A machine
    whose Hello has not come regroups nothing yet; one let in does."""
    from elastic_magic.agent.inbox import Inbox
    from elastic_magic.agent.machines.head import Head

    class Waiting:  # torch's rendezvous state, the head's outside
        def __init__(self, *agents: tuple[str, int]) -> None:
            self.agents, self.removed = set(agents), []

        def num_nodes_waiting(self) -> int:
            return len(self.agents)

        def waiting_agents(self) -> set[tuple[str, int]]:
            return set(self.agents)

        def remove_node(self, host: str, pid: int) -> int | None:
            self.removed.append((host, pid))
            self.agents.discard((host, pid))
            return None

    spec = em.JobSpec.create(1, nnodes="1:3", log_dir=log_dir)
    head = Head(spec, "em-test", lambda event: None, token="t",
                payload=build_payload("1", spec), inbox=Inbox())
    head.sent_away[7] = ("10.0.0.7", 70)
    head.names[8], head.pids[8] = "10.0.0.8", 80
    assert not head.nodes_waiting(Waiting())
    rendezvous = Waiting(("10.0.0.7", 70), ("10.0.0.9", 90))  # sent away; not greeted yet
    assert not head.nodes_waiting(rendezvous)
    assert rendezvous.removed == [("10.0.0.7", 70)]
    assert head.nodes_waiting(Waiting(("10.0.0.8", 80)))  # let in: the job regroups


@pytest.mark.unit
def test_a_machine_sent_away_that_asks_to_leave_at_a_commit_changes_nothing(log_dir):
    """Its allocation's cancel, asked again as it was sent away, goes through while its
    agent still ends: the scheduler's SIGTERM has it ask to leave at the next commit. It
    was never the job's: no regroup (CI once saw the job re-form for it), nothing marked."""
    from elastic_magic.agent.inbox import FromLink, Inbox
    from elastic_magic.agent.machines.head import Head
    from elastic_magic.wire.link_messages import LeaveAtCommit

    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir)
    head = Head(spec, "em-test", lambda event: None, token="t",
                payload=build_payload("1", spec), inbox=Inbox())
    head.sent_away[7] = ("10.0.0.7", 70)
    leaving = FromLink(None, 7, LeaveAtCommit("preempted"))  # type: ignore[arg-type]
    assert head.handle(leaving, None, None, 1) is None
    assert not head.launched.released and not head.launched.take_due()


@pytest.mark.unit
def test_scaling_machines_needs_a_launcher_and_stays_within_nnodes(log_dir):
    job = Job(em.JobSpec.create(1, nnodes="1:3", log_dir=log_dir),
              build_payload("1", em.JobSpec.create(1, log_dir=log_dir)))
    with pytest.raises(SpecError, match="needs a job started with --launcher"):
        job.scale_nodes(2)
    job = Job(em.JobSpec.create(1, nnodes="1:3", log_dir=log_dir, launcher="ssh",
                                launch=["hosts=a"]), build_payload("1", job.spec))
    with pytest.raises(SpecError, match="between 1 and 3 machines"):
        job.scale_nodes(4)


def test_a_scale_asked_before_the_job_starts_is_kept_and_one_after_it_ended_is_refused(
        log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:3", launcher="local", log_dir=log_dir, timeout=60)
    source = "import torch.distributed as dist\ndist.get_world_size()"
    job = Job(spec, build_payload(source, spec))
    job.scale_nodes(1)  # before the launcher exists: it starts with none to ask for
    result = job.start().wait(recorder)
    assert result.ok and result.values == {0: 1}, result
    assert [e.allocations for e in recorder.of(MachinesChanged) if e.allocations] == []
    with pytest.raises(ValueError, match="has already ended"):
        job.scale_nodes(2)


# -- the watchdog ----------------------------------------------------------------------


def test_the_watchdog_runs_what_is_left_when_the_kernel_is_gone(tmp_path):
    canary, dropped = tmp_path / "cancelled", tmp_path / "dropped"
    # A kernel that dies (SIGKILL): its watchdog runs what it still held.
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys
        from elastic_magic.launchers.watchdog import Watchdog
        dog = Watchdog()
        dog.add("1", [["touch", {str(canary)!r}]])
        dog.add("2", [["touch", {str(dropped)!r}]])
        dog.drop("2")
        print(dog.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    out, _ = kernel.communicate(timeout=60)
    watchdog_pid = int(out.split()[0])
    deadline = time.monotonic() + 30
    while not canary.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert canary.exists() and not dropped.exists()
    while Path(f"/proc/{watchdog_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init: it was in a session of its own
    # A job that ended cleanly: nothing is run.
    dog = Watchdog()
    dog.add("1", [["touch", str(dropped)]])
    dog.close()
    assert dog.proc.returncode == 0 and not dropped.exists()


def test_the_watchdog_fires_when_the_kernel_dies_while_another_process_holds_its_pipe(
        tmp_path):
    canary = tmp_path / "cancelled"
    # The kernel passed its end of the watchdog's pipe to a process that outlives it (as a
    # forked child would): the watchdog sees the kernel's own end through its pidfd.
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, subprocess, sys
        from elastic_magic.launchers.watchdog import Watchdog
        dog = Watchdog()
        dog.add("1", [["touch", {str(canary)!r}]])
        holder = subprocess.Popen(["sleep", "600"], pass_fds=[dog.proc.stdin.fileno()],
                                  stdout=subprocess.DEVNULL)
        print(holder.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    out, _ = kernel.communicate(timeout=60)
    holder = int(out.split()[0])
    try:
        deadline = time.monotonic() + 30
        while not canary.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert canary.exists()
        assert Path(f"/proc/{holder}").exists()  # the pipe was still open
    finally:
        os.kill(holder, signal.SIGKILL)  # the kernel's, now init's to reap


def test_a_token_file_is_removed_when_the_kernel_dies_whatever_its_allocations(tmp_path):
    token = tmp_path / "token"
    # The launcher wrote its token file, then the scheduler refused the job: no allocation
    # holds the file, and the kernel dies.
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, queue, signal
        from elastic_magic.launchers import JoinRequest, LauncherError
        from elastic_magic.launchers.cluster import Cluster
        class Refused:
            def start(self, request):
                open({str(token)!r}, "w").close()
                raise LauncherError("sbatch: error: invalid partition")
            def allocations(self): return []
            def orphan_cleanup(self, allocation_id): return []
            def orphan_files(self): return [{str(token)!r}]
        shown = queue.Queue()
        Cluster(Refused(), JoinRequest("h:1", "t", "run"), machines=1,
                publish=shown.put).start()
        while "invalid partition" not in "".join(shown.get(timeout=30)):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    """)], env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    assert kernel.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while token.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not token.exists()


def test_a_child_the_kernel_forks_does_not_hold_a_lifeline():
    read_end, write_end = os.pipe()
    pipe = os.fdopen(write_end, "wb")
    lifeline(pipe)
    child = os.fork()
    if child == 0:  # the lifeline's descriptor is /dev/null here
        os._exit(0 if stat.S_ISCHR(os.fstat(write_end).st_mode) else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert stat.S_ISFIFO(os.fstat(write_end).st_mode)  # the kernel's own is untouched
    pipe.close()
    assert os.read(read_end, 1) == b""  # no one else holds it
    os.close(read_end)


# -- what the notebook's folder and the config file may decide --------------------------


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Path:
    """The notebook's folder (a shared one) holds modules that the watchdog and a join
    import (configparser, getpass): each would leave a file saying it ran."""
    start = tmp_path / "start"
    start.mkdir()
    for name in ("configparser", "getpass", "json"):
        (start / f"{name}.py").write_text(
            f"open({str(tmp_path / ('ran-' + name))!r}, 'w').close()\n")
    monkeypatch.chdir(start)
    return tmp_path


def _ran(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("ran-*"))


def test_nothing_is_imported_from_the_notebooks_folder(planted):
    dog = Watchdog()
    dog.add("1", [["true"]])
    dog.close()
    assert dog.proc.returncode == 0
    launcher = make_launcher("local", {"machines": "1"})
    launcher.start(JoinRequest("not-an-endpoint", "token", "run"))
    deadline = time.monotonic() + 60
    while (state := launcher.allocations()[0]).state != "ended" and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.cancel_all()
    assert "exit 2: elastic-magic join: 'not-an-endpoint' is not HOST:PORT" in state.reason
    assert _ran(planted) == []


def test_remote_joins_import_nothing_from_their_working_directory(planted, tmp_path):
    request = JoinRequest("not-an-endpoint", "token", "run")
    start = Path.cwd()
    # The command an ssh login runs, in its shell, in the (hostile) workdir.
    ssh = make_launcher("ssh", {"hosts": "lab1", "python": sys.executable,
                                "workdir": str(start)})
    argv, _ = ssh._command("lab1", request, "lab1#1")
    assert argv[-3:-1] == ["--", "lab1"]  # after --: a host, never an option
    done = subprocess.run(["sh", "-c", argv[-1]], input="token\n", capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})
    assert done.returncode == 2 and "is not HOST:PORT" in done.stderr
    # The Slurm batch script, with an srun that runs its command where it is.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\n'
                                  'exec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    slurm = make_launcher("slurm", {"workdir": str(start)})
    script = slurm.script(request, tmp_path / "token")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd="/",
                          env={**os.environ, "PYTHONPATH": PACKAGE_PARENT,
                               "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 2 and "is not HOST:PORT" in done.stderr
    assert _ran(planted) == []


@pytest.mark.unit
def test_a_launcher_config_another_user_could_write_is_refused(tmp_path, monkeypatch):
    config = tmp_path / "launchers.ini"
    config.write_text("[ssh]\nhosts = lab1\nssh = /tmp/their-ssh\n")
    monkeypatch.setenv(CONFIG_VARIABLE, str(config))
    assert launcher_options("ssh", {})["hosts"] == "lab1"  # the user's own: read
    config.chmod(0o666)
    with pytest.raises(SpecError, match=r"open to other users .* chmod go-w"):
        em.JobSpec.create(1, nnodes="1:2", launcher="ssh")
    config.chmod(0o644)
    if os.geteuid() == 0:  # root can give the file away
        os.chown(config, 65534, -1)
        with pytest.raises(SpecError, match="belongs to user id 65534, not to you"):
            launcher_options("ssh", {})
        os.chown(config, 0, -1)
    link = tmp_path / "link.ini"
    link.symlink_to(config)
    monkeypatch.setenv(CONFIG_VARIABLE, str(link))
    with pytest.raises(SpecError, match="is a symbolic link"):
        launcher_options("ssh", {})
    monkeypatch.setenv(CONFIG_VARIABLE, "launchers.ini")  # in whatever folder the kernel is
    with pytest.raises(SpecError, match="by its absolute path"):
        launcher_options("ssh", {})
    with pytest.raises(SpecError, match="is not a host name"):
        make_launcher("ssh", {"hosts": "lab1,-oProxyCommand=evil"})


def test_slurm_jobs_print_into_a_private_folder_of_the_users_not_the_working_one(tmp_path):
    """Slurm's default ``slurm-%j.out`` lands in the job's working folder (a shared one,
    say) with the user's umask: the sbatch command names a file of a 0700 output folder for
    both streams; a folder that is not the user's own and private is refused before
    sbatch runs, and so is a name Slurm would read as a pattern."""
    output = tmp_path / "output"
    launcher = make_launcher("slurm", {"output_dir": str(output)})
    assert f"--output={output}/%x-%j.out" in launcher.sbatch
    assert f"--error={output}/%x-%j.out" in launcher.sbatch
    default = make_launcher("slurm", {}).sbatch
    assert f"--output={Path.home()}/.cache/elastic_magic/slurm/%x-%j.out" in default
    for bad in ("output", str(tmp_path / "100%")):
        with pytest.raises(SpecError, match="by its absolute path, without %"):
            make_launcher("slurm", {"output_dir": bad})
    output.mkdir(mode=0o755)
    output.chmod(0o755)  # whatever the umask
    launcher = make_launcher("slurm", {"output_dir": str(output),
                                       "token_dir": str(tmp_path / "tokens")})
    with pytest.raises(LauncherError, match=r"must be a folder of yours alone \(chmod 700\)"):
        launcher.start(JoinRequest("h:1", "t", "run"))
    assert not (tmp_path / "tokens").exists()  # refused before anything was written
    # A private folder in a team's folder that others can write: one of them could rename
    # it and put an open one at its name before Slurm writes there.
    team = tmp_path / "team"
    team.mkdir()
    team.chmod(0o777)
    launcher = make_launcher("slurm", {"output_dir": str(team / "output"),
                                       "token_dir": str(tmp_path / "tokens")})
    with pytest.raises(LauncherError, match=r"whoever can write it can put another folder"):
        launcher.start(JoinRequest("h:1", "t", "run"))
    assert not (team / "output").exists() and not (tmp_path / "tokens").exists()


# -- SSH, against real servers in network namespaces ------------------------------------


def _processes_holding(secret: str) -> list[str]:
    """Every process on this machine whose command line holds ``secret``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if secret.encode() in cmdline:
                found.append(f"{entry.name}: {cmdline!r}")
    return found


def _in_namespaces(network, program: str) -> list[str]:
    """PIDs in the machines' namespaces whose command line names ``program``."""
    found = []
    for i in range(1, network.machines + 1):
        pids = subprocess.run(["ip", "netns", "pids", network.namespace(i)],
                              capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if program.encode() in cmdline:
                found.append(f"{i}:{pid}:{cmdline!r}")
    return found


@pytest.mark.parametrize("network", [2], indirect=True)
def test_ssh_grows_a_training_job_from_one_machine_to_three(
        baseline, network, tmp_path, log_dir, recorder):
    options = start_sshd(network, tmp_path / "ssh")
    spec = em.JobSpec.create(1, nnodes="1:3", rdzv_endpoint=network.head_address,
                             launcher="ssh", launch=[f"{k}={v}" for k, v in options.items()],
                             log_dir=log_dir, timeout=60)
    grown = tmp_path / "grown"  # step 30 waits for it: the job cannot end before growing
    payload = build_payload(TRAIN, spec, namespace={"KILL_AT": -1, "PAUSE": 0.3,
                                                    "HOLDS": {30: str(grown)}})
    job = Job(spec, payload).start()
    seen: dict[str, object] = {}

    def watch() -> None:  # once every machine trains: where the token is, what status says
        try:
            status = job._board.wait_for(lambda s: s.nnodes == 3, timeout=120)
            seen["nnodes"] = status.nnodes
            seen["machines"] = status.machines
            seen["status"] = job.status()
            seen["holding"] = _processes_holding(job.token or "?")
        finally:  # whatever happened here, training goes on (and the asserts say what)
            grown.touch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = job.wait(recorder)
    watcher.join(timeout=10)
    assert result.ok, result
    # Machines joined as their ssh sessions came up: it began smaller and grew to three.
    sizes = [r.nnodes for r in recorder.of(RendezvousCompleted)]
    assert sizes[0] < 3 and sizes[-1] == 3, sizes
    assert seen["nnodes"] == 3
    assert len(seen["machines"]) == 2 and all("running" in m for m in seen["machines"]), seen
    assert "machines" in seen["status"]
    assert seen["holding"] == [], seen["holding"]  # the token in no command line
    # The dashboard's timeline (and the text output) says what the launcher holds.
    dashboard = DashboardState(result.run_id, str(result.log_dir), 0)
    for event in recorder.events:
        dashboard.apply(event)
    lines = [e["text"] for e in dashboard.timeline if e["text"].startswith("launcher: ")]
    assert any(f"{network.address(2)}#2: running on {network.address(2)}" in line
               for line in lines), lines
    assert lines[-1] == "launcher: no allocation left"
    assert done_steps(recorder) == list(range(1, STEPS + 1))
    assert_same_parameters(result.values[0], baseline, atol=1e-5)
    # Nothing left: no join, no ssh session on any machine (sshd itself stays).
    deadline = time.monotonic() + 30
    while _in_namespaces(network, "elastic_magic.cli") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _in_namespaces(network, "elastic_magic.cli") == []
    assert job.status_snapshot.machines == ()


HEAD = textwrap.dedent("""
    import json, sys, time
    import elastic_magic as em
    from elastic_magic.agent.handles.job import Job
    from elastic_magic.wire.payload import build_payload
    spec = em.JobSpec.create(1, nnodes=sys.argv[5], rdzv_endpoint=sys.argv[1],
                             launcher=sys.argv[2], launch=json.loads(sys.argv[3]),
                             log_dir=sys.argv[4], timeout=60)
    job = Job(spec, build_payload("import time\\nwhile True: time.sleep(0.1)", spec)).start()
    while True:
        print(json.dumps({"nnodes": job.status_snapshot.nnodes,
                          "machines": job.status_snapshot.machines}), flush=True)
        if job.done:
            sys.exit(f"the job ended: {job.result}")
        time.sleep(0.5)
""")


def start_head(network, tmp_path, launcher: str, options: dict[str, str],
               nnodes: str = "1:3") -> subprocess.Popen[str]:
    """A kernel stand-in: a process whose thread runs the head of a job with a launcher
    (the job's cell never ends), printing its status twice a second."""
    return subprocess.Popen(
        [sys.executable, "-c", HEAD, network.head_address, launcher,
         json.dumps([f"{k}={v}" for k, v in options.items()]), str(tmp_path / "head-logs"),
         nnodes],
        stdout=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env={**os.environ, "PYTHONPATH": PACKAGE_PARENT})


def wait_for_status(head: subprocess.Popen[str], ready, timeout: float = 120) -> dict:
    assert head.stdout is not None
    deadline = time.monotonic() + timeout
    for line in head.stdout:
        status = json.loads(line)
        if ready(status):
            return status
        assert time.monotonic() < deadline, status
    raise AssertionError(f"the head exited ({head.wait()})")


def end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()  # ours, by PID
    proc.wait()


@pytest.mark.parametrize("network", [2], indirect=True)
def test_a_kernel_killed_outright_leaves_no_remote_process(network, tmp_path):
    options = start_sshd(network, tmp_path / "ssh")
    head = start_head(network, tmp_path, "ssh", options)
    try:
        wait_for_status(head, lambda s: s["nnodes"] == 3)
        assert len(_in_namespaces(network, "elastic_magic.cli")) == 2
        assert len(_in_namespaces(network, "sshd: root@")) == 2  # their sessions
        head.kill()  # SIGKILL: no cleanup of its own runs
        head.wait()
        deadline = time.monotonic() + 30  # the joins leave at their stdin's end, at once
        while (_in_namespaces(network, "elastic_magic.cli")
               or _in_namespaces(network, "sshd: root@")) and time.monotonic() < deadline:
            time.sleep(0.2)  # then their sessions close
        assert _in_namespaces(network, "elastic_magic.cli") == []
        assert _in_namespaces(network, "sshd: root@") == []  # no session left either
    finally:
        end(head)


@pytest.mark.parametrize("network", [2], indirect=True)
def test_scale_gives_a_machine_back_at_a_commit_and_ends_its_session(
        baseline, network, tmp_path, log_dir, recorder):
    options = start_sshd(network, tmp_path / "ssh")
    spec = em.JobSpec.create(1, nnodes="1:3", rdzv_endpoint=network.head_address,
                             launcher="ssh", launch=[f"{k}={v}" for k, v in options.items()],
                             log_dir=log_dir, timeout=60)
    # Steps 20 and 30 wait for these (the scale is asked, the machine has left): the job
    # cannot end before either, however slowly the machines come up.
    scaled, shrunk = tmp_path / "scaled", tmp_path / "shrunk"
    payload = build_payload(TRAIN, spec, namespace={
        "KILL_AT": -1, "PAUSE": 0.3, "HOLDS": {20: str(scaled), 30: str(shrunk)}})
    job = Job(spec, payload).start()
    seen: dict[str, object] = {}

    def drive() -> None:  # once three machines train: give one back
        try:
            job._board.wait_for(lambda s: s.nnodes == 3, timeout=120)
            job.scale_nodes(2)
            scaled.touch()
            job._board.wait_for(lambda s: s.nnodes == 2, timeout=120)
        finally:  # whatever happened here, training goes on (and the asserts say what)
            scaled.touch()
            shrunk.touch()
        deadline = time.monotonic() + 30  # the one given back exits once it has left
        while len(_in_namespaces(network, "elastic_magic.cli")) > 1 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        seen["joins"] = len(_in_namespaces(network, "elastic_magic.cli"))

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        result = job.wait(recorder)
    except AgentError as exc:  # what the job went through, as the dashboard tells it
        raise AssertionError(f"{exc}\n{recorder.story()}") from exc
    driver.join(timeout=10)
    assert result.ok, f"{result}\n{recorder.story()}"
    sizes = [r.nnodes for r in recorder.of(RendezvousCompleted)]
    assert 3 in sizes and sizes[-1] == 2, f"{sizes}\n{recorder.story()}"
    assert result.restarts == 0  # a membership change at a commit, not a failure
    left = [e for e in recorder.of(NodeConnected) if not e.connected]
    assert any("left at a commit: given back to the scheduler" in e.reason for e in left), left
    assert seen["joins"] <= 1  # its join exited (the job may have ended meanwhile too)
    assert done_steps(recorder) == list(range(1, STEPS + 1))  # no step lost or run twice
    assert_same_parameters(result.values[0], baseline, atol=1e-5)


@pytest.mark.parametrize("network", [1], indirect=True)
def test_a_machine_preempted_below_min_fails_the_job_naming_it(network, tmp_path, log_dir,
                                                                recorder):
    options = start_sshd(network, tmp_path / "ssh")
    spec = em.JobSpec.create(1, nnodes="2:2", rdzv_endpoint=network.head_address,
                             launcher="ssh", launch=[f"{k}={v}" for k, v in options.items()],
                             log_dir=log_dir, timeout=60)
    job = Job(spec, build_payload("import time\nwhile True: time.sleep(0.1)", spec)).start()

    def preempt() -> None:  # the scheduler's SIGTERM to the machine's join
        job.wait_for_running(timeout=120)
        (found,) = _in_namespaces(network, "elastic_magic.cli")
        os.kill(int(found.split(":")[1]), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    result = job.wait(recorder)
    assert not result.ok
    assert "scheduler sent SIGTERM (preempted or cancelled)" in result.failure.reason, result


# -- the Cluster's policy, with a launcher that records (no scheduler) -------------------


class Recording:
    """A launcher whose allocations the test moves by hand."""

    name = "recording"

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.cancelled: list[str] = []
        self.all_cancelled = False

    def start(self, request):
        allocation_id = str(len(self.states) + 1)
        self.states[allocation_id] = "pending"
        return Allocation(allocation_id, "pending")

    def allocations(self):
        return [Allocation(i, s, "Priority" if s == "pending" else "")
                for i, s in self.states.items() if i not in self.cancelled]

    def cancel(self, allocation_id):
        self.cancelled.append(allocation_id)

    def cancel_all(self):
        self.all_cancelled = True

    def orphan_cleanup(self, allocation_id):
        return [["true"]]

    def orphan_files(self):
        return []


def test_the_cluster_grows_replaces_and_gives_back_pending_ones_first():
    launcher = Recording()
    shown: list[tuple[str, ...]] = []
    released: list[str] = []
    cluster = Cluster(launcher, JoinRequest("h:1", "t", "run"), machines=3,
                      publish=shown.append, release=released.append, poll_interval=0.02)
    cluster.start()

    def settle(check) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, (launcher.states, shown)
            time.sleep(0.02)

    settle(lambda: len(launcher.states) == 3)
    settle(lambda: shown and "1: pending (Priority)" in shown[-1])
    for allocation_id in ("1", "2", "3"):  # their machines joined the job
        launcher.states[allocation_id] = "running"
        cluster.joined(allocation_id)
    launcher.states["3"] = "ended"  # preempted, say: replaced once the head heard it go
    cluster.left("3")
    settle(lambda: len(launcher.states) == 4)
    cluster.scale(1)  # 4 waits, so it goes first; then the newest running one leaves
    settle(lambda: launcher.cancelled == ["4"] and released == ["2"])
    assert shown[-1][-1] == "2: leaving at the next commit"
    cluster.cancel_later("2")  # the head: it has left the job
    settle(lambda: launcher.cancelled == ["4", "2"])
    cluster.close()
    assert launcher.all_cancelled and shown[-1] == ()
    assert cluster.watchdog is not None and cluster.watchdog.proc.returncode == 0


class Scripted(Recording):
    """Each start does what the script says next: "ok" (it waits), "fail" (it ends at once,
    as a job whose node cannot run the join does) or "refuse" (the scheduler says no)."""

    def __init__(self, script: list[str]) -> None:
        super().__init__()
        self.script = script
        self.polls = 0

    def start(self, request):
        outcome = self.script.pop(0) if self.script else "ok"
        if outcome == "refuse":
            raise LauncherError("sbatch: error: invalid partition specified: gpu")
        allocation = super().start(request)
        if outcome == "fail":
            self.states[allocation.id] = "ended"
        return allocation

    def allocations(self):
        self.polls += 1
        return [Allocation(i, s, "NonZeroExitCode" if s == "ended" else "")
                for i, s in self.states.items() if i not in self.cancelled]


def test_machines_that_fail_to_come_up_are_asked_for_less_often_then_no_more():
    launcher = Scripted(["fail", "fail", "ok", "fail", "refuse", "fail", "ok"])
    shown: list[tuple[str, ...]] = []
    cluster = Cluster(launcher, JoinRequest("h:1", "t", "run"), machines=1,
                      publish=shown.append, poll_interval=0.005, retry_delay=0.01,
                      max_failures=3)
    cluster.start()

    def settle(check) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, (launcher.states, shown)
            time.sleep(0.005)

    def said(fragment: str) -> bool:
        return any(fragment in line for lines in shown for line in lines)

    settle(lambda: launcher.states.get("3") == "pending")  # the third came up
    assert said("asking for a machine again in 0.01s (1 failed in a row; the last: "
                "1 ended before its machine joined: NonZeroExitCode)")
    assert said("again in 0.02s (2 failed in a row; the last: 2 ended")  # doubled
    launcher.states["3"] = "running"
    cluster.joined("3")  # its machine joined: the streak ends
    launcher.states["3"] = "ended"  # then it is preempted: replaced at once
    cluster.left("3")  # (once the head has heard its link end)
    settle(lambda: said("no more machines asked for"))
    # Three more failures in a row (one a refusal), counted afresh after the join.
    assert said("again in 0.02s (2 failed in a row; the last: cannot start a machine: "
                "sbatch: error: invalid partition specified: gpu)")
    assert shown[-1][-1] == ("no more machines asked for (3 failed in a row; the last: 5 "
                             "ended before its machine joined: NonZeroExitCode); "
                             "`%elastic scale --nodes N` asks again")
    polls = launcher.polls
    settle(lambda: launcher.polls > polls + 5)
    assert sorted(launcher.states) == ["1", "2", "3", "4", "5"]  # nothing more asked for
    cluster.scale(1)  # the user asks again: at once
    settle(lambda: launcher.states.get("6") == "pending")
    settle(lambda: shown[-1][0] == "6: pending")
    assert not any("failed in a row" in line for line in shown[-1]), shown[-1]
    cluster.close()
    assert launcher.all_cancelled


def test_machines_leaving_at_the_jobs_end_are_not_replaced():
    """A joined machine's allocation that ended waits for the head's word: replaced once
    its link has ended without the job ending (a preemption), never once it is ending."""
    launcher = Scripted([])
    cluster = Cluster(launcher, JoinRequest("h:1", "t", "run"), machines=2,
                      publish=lambda lines: None, poll_interval=0.005)
    cluster.start()

    def settle(check) -> None:
        deadline = time.monotonic() + 10
        while not check():
            assert time.monotonic() < deadline, launcher.states
            time.sleep(0.005)

    settle(lambda: len(launcher.states) == 2)
    for allocation_id in ("1", "2"):
        launcher.states[allocation_id] = "running"
        cluster.joined(allocation_id)
    launcher.states["1"] = "ended"  # its machine left: the head has not heard it yet
    polls = launcher.polls
    settle(lambda: launcher.polls > polls + 5)
    assert len(launcher.states) == 2
    cluster.left("1")  # its link ended, and the job goes on: replaced
    settle(lambda: len(launcher.states) == 3)
    cluster.ending()  # the job is over: its machines go first
    cluster.left("2")
    launcher.states["2"] = launcher.states["3"] = "ended"
    polls = launcher.polls
    settle(lambda: launcher.polls > polls + 5)
    assert sorted(launcher.states) == ["1", "2", "3"]  # none asked for
    cluster.close()


def test_a_local_job_that_grows_and_ends_asks_for_no_replacement(log_dir, recorder, tmp_path):
    """At the job's end its joined machines leave first: each ended allocation was taken
    for a lost machine and replaced (``local1#3``, cancelled seconds later; with Slurm, a
    needless sbatch). Here the head's rank ends last, once the launcher has seen both
    joined machines' allocations end."""
    spec = em.JobSpec.create(1, nnodes="1:3", launcher="local", log_dir=log_dir, timeout=60)
    go = tmp_path / "go"
    # It runs until three machines are in its group (each join re-forms it), then ends.
    source = textwrap.dedent(f"""
        import os, time, torch.distributed as dist
        while os.environ["GROUP_WORLD_SIZE"] != "3":
            time.sleep(0.05)
        size = dist.get_world_size()  # every rank's process group is up
        if "ELASTIC_MAGIC_ALLOCATION" not in os.environ:  # the head's rank
            while not os.path.exists({str(go)!r}):
                time.sleep(0.05)
        size
    """)
    job = Job(spec, build_payload(source, spec)).start()
    joined = ("local1#1: running", "local2#2: running")
    stuck: list[str] = []

    def drive() -> None:  # both joined machines done, and the launcher has looked since
        for what, ready in (
                ("three machines", lambda s: s.nnodes == 3),
                ("the joined machines' end", lambda s: not any(
                    m.startswith(joined) for m in s.machines))):
            status = job._board.wait_for(ready, timeout=120)
            if not ready(status) and not status.done:  # end it, saying what it waited for
                stuck.append(f"no {what} in 120 s: {status}")
                job.stop(stuck[-1])
                return
        go.touch()

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    result = job.wait(recorder)
    driver.join(timeout=10)
    # The joined machines' ranks write their logs under this user's cache (failed once
    # in a full run, 1 of about 30: a third group formed without a word on the head).
    logs = cache_folder()
    joined_logs = "\n".join(
        f"==> {path} <==\n{path.read_text(errors='replace')[-2000:]}"
        for path in sorted((logs / "logs" / job.run_id).glob("group_*/rank_*/*.log"))
    ) if logs is not None else ""
    assert not stuck, f"{stuck}\n{recorder.story()}\n{joined_logs}"
    assert result.ok and set(result.values.values()) == {3}, \
        f"{result}\n{recorder.story()}\n{joined_logs}"
    asked = {line.split(":")[0] for e in recorder.of(MachinesChanged) for line in e.allocations
             if "#" in line.split(":")[0]}
    assert asked == {"local1#1", "local2#2"}, asked  # the two machines, and no other


def test_the_local_launcher_starts_a_machine_and_leaves_no_process(log_dir, recorder):
    """...nor anything for Python's cyclic collector: the head's job, dropped, goes with
    its result's last commit (a memory file as large as the training state) at once."""
    from elastic_magic.agent.machines.head import Head

    spec = em.JobSpec.create(1, nnodes="2:2", launcher="local", log_dir=log_dir, timeout=60)
    source = ("import os, torch.distributed as dist, elastic_magic\n"
              "elastic_magic.State(step=1).commit()\n"
              "(dist.get_world_size(), os.environ['GROUP_WORLD_SIZE'])")
    gc.collect()
    gc.disable()  # what a cycle holds stays listed in gc.get_objects()
    try:
        job = Job(spec, build_payload(source, spec)).start()
        result = job.wait(recorder)
        assert result.ok, f"{result}\n{recorder.story()}"
        assert set(result.values.values()) == {(2, "2")}
        assert result.snapshot_source is not None  # the commit, in a memory file
        endpoint = next(e.endpoint for e in recorder.events
                        if type(e).__name__ == "AcceptingNodes")
        assert _processes_holding(endpoint) == []  # its join exited with the job
        assert job.status_snapshot.machines == ()
        # the timeline names the machine by its address and the allocation it ran in
        (joined,) = [e.peer for e in recorder.of(NodeConnected) if e.connected]
        assert re.fullmatch(r"127\.0\.0\.1 \(local\S+\)", joined), joined
        gone, run_id = weakref.ref(job), job.run_id
        del job, result
        assert gone() is None  # (other tests' jobs may be alive: this one is not)
        assert not [o for o in gc.get_objects() if isinstance(o, Head) and o.run_id == run_id]
    finally:
        gc.enable()


def test_a_launcher_another_distribution_registers_drives_a_session(tmp_path, monkeypatch):
    """A scheduler added by entry point, without touching elastic_magic: an installed
    distribution's ``elastic_magic.launchers`` entry names its class, and a session with
    ``--nnodes`` grows onto the machines it starts and ends them with the session."""
    site = tmp_path / "site"
    (site / "thirdparty-1.0.dist-info").mkdir(parents=True)
    (site / "thirdparty-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty\nVersion: 1.0\n")
    (site / "thirdparty-1.0.dist-info" / "entry_points.txt").write_text(
        "[elastic_magic.launchers]\ncounting = thirdparty_launcher:CountingLauncher\n")
    (site / "thirdparty_launcher.py").write_text(textwrap.dedent("""
        from elastic_magic.launchers.local import LocalLauncher

        class CountingLauncher(LocalLauncher):
            name = "counting"
            started = []

            def start(self, request):
                allocation = super().start(request)
                CountingLauncher.started.append(allocation.id)
                return allocation
    """))
    monkeypatch.syspath_prepend(str(site))
    assert "counting" in launcher_names()
    import psutil

    session = em.Session(1, nnodes="2:2", launcher="counting", timeout=60,
                         render=lambda events: None)
    try:
        result = session.run("import torch.distributed as dist\ndist.get_world_size()")
        assert set(result.values.values()) == {2}, result.values
        import thirdparty_launcher

        assert len(thirdparty_launcher.CountingLauncher.started) == 1  # the second machine
        joins = [p for p in psutil.Process().children(recursive=True)
                 if "join" in p.cmdline()]
        assert len(joins) == 1, joins
    finally:
        session.stop()
    psutil.wait_procs(joins, timeout=10)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in joins)
