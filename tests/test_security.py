"""Nothing that arrives over a socket a job opens is unpickled or acted on without the job's
secret. A rogue client without the token, a plain torch TCPStore client in this process,
writes forged pickles into every key of every TCPStore the job exposes; the job must end
with a clear error, never run the pickle, and leave no port, thread or worker behind. Real
jobs, real `elastic-magic join` processes, on loopback."""

from __future__ import annotations

import base64
import json
import os
import pickle
import pty
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from conftest import tagged_workers
from test_multinode import Machines, run_head
from torch.distributed import TCPStore

import elastic_magic as em
from elastic_magic.agent.handles.job import AgentError, Job
from elastic_magic.agent.machines.hub import connect
from elastic_magic.wire.events import AcceptingNodes, NodeConnected, Output, RendezvousCompleted
from elastic_magic.wire.link_messages import Hello
from elastic_magic.wire.payload import build_payload
from elastic_magic.wire.protocol import MAX_FRAME, Channel, ProtocolError, new_secret

REJECTED = "unauthenticated rendezvous state rejected"
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(300)\n"


class _Pwn:
    """Unpickling this creates the canary file: code execution, made visible."""

    def __init__(self, canary: Path) -> None:
        self.canary = str(canary)

    def __reduce__(self):
        return exec, (f"open({self.canary!r}, 'w').write('pwned')",)


def forgeries(canary: Path) -> dict[str, bytes]:
    raw = pickle.dumps(_Pwn(canary))
    return {"raw": raw, "base64": base64.b64encode(raw)}


def listening_ports(pid: int | None = None) -> set[int]:
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def job_threads() -> set[threading.Thread]:
    """Our threads, and torch's rendezvous heartbeat; not the warm pool's, which is kept
    between jobs by design (test_pool)."""
    return {t for t in threading.enumerate()
            if t.name.startswith(("elastic-", "RendezvousKeepAliveTimer"))
            and t.name != "elastic-pool"}


def forge_every_store(ports: set[int], values: list[bytes]) -> dict[int, list[str]]:
    """Connect to each port as a token-less TCPStore client, list its keys and overwrite
    every one with each forged value in turn. The keys written, by store port."""
    written: dict[int, list[str]] = {}
    for port in sorted(ports):
        try:
            store = TCPStore("127.0.0.1", port, is_master=False,
                             timeout=timedelta(seconds=3))
            keys = store.list_keys()
        except Exception:
            continue  # not a TCPStore (the hub): its handshake refuses us
        for key in keys:
            for value in values:
                try:
                    store.set(key, value)
                except Exception:
                    break  # the job already ended and closed the store
        written[port] = keys
        del store
    return written


def until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def assert_nothing_left(ports_before: set[int], threads_before: set[threading.Thread]) -> None:
    """The ended job holds no listening port, no thread and no worker of its own."""
    assert until(lambda: listening_ports() <= ports_before, 10), \
        f"ports left listening: {listening_ports() - ports_before}"
    assert until(lambda: job_threads() <= threads_before, 10), \
        f"threads left: {[t.name for t in job_threads() - threads_before]}"
    assert not tagged_workers()


@pytest.mark.parametrize("encoding", ["raw", "base64"])
def test_forged_writes_into_a_standalone_jobs_stores_end_it_and_run_nothing(
        tmp_path, log_dir, recorder, encoding):
    canary = tmp_path / "pwned"
    ports_before, threads_before = listening_ports(), job_threads()
    spec = em.JobSpec.create(1, log_dir=log_dir)
    job = Job(spec, build_payload(SLEEPER, spec, namespace={})).start()
    written: dict[int, list[str]] = {}

    def rogue() -> None:
        until(lambda: "up" in recorder.lines(0) or job.done, 60)
        # Every local user can reach loopback: whatever the kernel listens on is fair game.
        written.update(forge_every_store(listening_ports() - ports_before,
                                         [forgeries(canary)[encoding]]))

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    started = time.monotonic()
    with pytest.raises(AgentError, match=REJECTED):
        job.wait(recorder)
    thread.join(timeout=30)
    # Noticed within torch's heartbeat interval (5 s), not at some later read.
    assert time.monotonic() - started < 60
    keys = [k for ks in written.values() for k in ks]
    assert f"torch.rendezvous.{job.run_id}" in keys, written  # the state torch unpickles
    assert len(written) == 2, written  # the rendezvous store and the round's worker store
    assert not canary.exists(), "a forged pickle ran"
    assert job.state is em.JobState.FAILED
    assert_nothing_left(ports_before, threads_before)
    job.stop()  # after the end: harmless


def test_forged_writes_into_a_multi_node_heads_stores_end_the_job_everywhere(
        tmp_path, log_dir, recorder):
    canary = tmp_path / "pwned"
    machines = Machines(tmp_path)
    ports_before, threads_before = listening_ports(), job_threads()
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    seen: dict[str, object] = {}
    forged = threading.Event()

    def drive(job: Job) -> None:
        try:
            # Both machines' ranks run the cell.
            until(lambda: {0, 1} <= {e.rank for e in recorder.of(Output)} or job.done, 120)
            (node,) = machines.procs
            seen["cmdline"] = " ".join(psutil.Process(node.pid).cmdline())
            # The kernel's stores, and any the other machine hosts.
            ports = listening_ports() - ports_before | listening_ports(node.pid)
            seen["written"] = forge_every_store(ports, list(forgeries(canary).values()))
        finally:
            forged.set()

    try:
        with pytest.raises(AgentError, match=REJECTED):
            run_head(spec, SLEEPER, recorder, machines, on_open=lambda: machines.join(1),
                     drive=drive)
        assert forged.wait(timeout=60)
        (command,) = [e.command for e in recorder.of(AcceptingNodes)]
        # The machine that joined ended too, and nothing showed the token in ps.
        assert machines.procs[0].wait(timeout=60) in (0, 1), machines.output(0)
    finally:
        machines.reap()
    # The command the notebook showed names the token's file, gone with the job.
    token_file = Path(command.split("--token-file ")[1])
    assert machines.token not in command and not token_file.exists(), command
    assert machines.token and machines.token not in seen["cmdline"]
    written = seen["written"]
    assert isinstance(written, dict)
    keys = [k for ks in written.values() for k in ks]
    assert any(k.startswith("torch.rendezvous.") and "/" not in k for k in keys), written
    assert "elastic_magic/hub" in keys, written
    assert not canary.exists(), "a forged pickle ran"
    assert_nothing_left(ports_before, threads_before)


@pytest.mark.parametrize("then_stop", [False, True], ids=["alone", "with_stop"])
def test_a_forged_state_while_the_head_waits_for_machines_ends_the_job_at_once(
        tmp_path, log_dir, recorder, then_stop):
    canary = tmp_path / "pwned"
    ports_before, threads_before = listening_ports(), job_threads()
    # The join timeout is past pytest's limit: only the rejection (or a stop) ends it.
    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=900)
    job = Job(spec, build_payload("x = 1", spec, namespace={})).start()

    def rogue() -> None:
        until(lambda: bool(recorder.of(AcceptingNodes)), 60)
        endpoint = recorder.of(AcceptingNodes)[0].endpoint
        store = TCPStore("127.0.0.1", int(endpoint.rpartition(":")[2]), is_master=False,
                         timeout=timedelta(seconds=3))
        store.set(f"torch.rendezvous.{job.run_id}", forgeries(canary)["base64"])
        del store
        if then_stop:  # whichever the agent sees first, the job ends
            job.stop()

    threading.Thread(target=rogue, daemon=True).start()
    started = time.monotonic()
    try:
        result = job.wait(recorder)
        assert then_stop and result.state is em.JobState.STOPPED, result
    except AgentError as exc:
        assert REJECTED in str(exc)
    assert time.monotonic() - started < 30
    assert not canary.exists(), "a forged pickle ran"
    assert_nothing_left(ports_before, threads_before)


def test_an_oversized_frame_from_a_peer_with_the_token_closes_only_its_link(
        tmp_path, log_dir, recorder):
    ports_before, threads_before = listening_ports(), job_threads()
    spec = em.JobSpec.create(1, nnodes="1:2", log_dir=log_dir, timeout=120)
    job = Job(spec, build_payload(SLEEPER, spec, namespace={})).start()
    seen: dict[str, object] = {}

    def peer() -> None:
        until(lambda: "up" in recorder.lines(0) or job.done, 60)
        assert job.token is not None
        link, _offer = connect(recorder.of(AcceptingNodes)[0].endpoint, job.token)
        link.send(Hello("rogue-peer", 1))
        # A valid frame header announcing 2**40 bytes (and a MAC that is never checked).
        link.sock.sendall(struct.pack("!Q", 1 << 40) + bytes(32))
        link.sock.settimeout(10)
        try:
            seen["after"] = link.sock.recv(1)  # b"": the head closed the link
        except OSError as exc:
            seen["after"] = exc
        link.close()
        until(lambda: any(not e.connected for e in recorder.of(NodeConnected)), 10)
        seen["state"] = job.state
        # A token-less client that connects to the hub (its address is in the store) and
        # says nothing: the hub must not wait out the handshake's timeout when it closes.
        store = TCPStore("127.0.0.1", int(recorder.of(AcceptingNodes)[0].endpoint
                                          .rpartition(":")[2]), is_master=False)
        host, _, port = store.get("elastic_magic/hub").decode().split()[-1].rpartition(":")
        del store
        seen["silent"] = socket.create_connection((host, int(port)))
        job.stop()

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    result = job.wait(recorder)
    thread.join(timeout=30)
    silent = seen["silent"]
    assert isinstance(silent, socket.socket)
    with silent:
        assert until(lambda: job_threads() <= threads_before, 3), \
            [t.name for t in job_threads() - threads_before]
        silent.settimeout(5)
        received = b""
        while chunk := silent.recv(1024):  # a timeout here: the hub left it open
            received += chunk
        assert len(received) == 32  # the hub's challenge, and nothing after it
    assert seen.get("after") == b"" or isinstance(seen.get("after"), ConnectionError), seen
    joined, left = recorder.of(NodeConnected)
    assert joined.connected and joined.peer == "rogue-peer"
    assert not left.connected and left.peer == "rogue-peer"
    assert f"{1 << 40} bytes" in left.reason and "limit" in left.reason, left.reason
    # The job itself went on running until it was stopped.
    assert seen["state"] is em.JobState.RUNNING
    assert result.state is em.JobState.STOPPED
    assert_nothing_left(ports_before, threads_before)


@pytest.mark.unit
def test_a_frame_above_the_limit_is_refused_before_anything_is_allocated():
    assert MAX_FRAME < 1 << 40  # this machine's memory
    key = new_secret()
    for header, limit, refused in (
        (struct.pack("!Q", 1 << 40) + bytes(32), MAX_FRAME, r"1099511627776 bytes, more than "),
        (None, 200, None),  # a real frame within the limit passes
        (None, 64, "more than the 64-byte limit"),
    ):
        r, w = os.pipe()
        try:
            if header is None:
                Channel(w, key).send("x" * 100)
            else:
                os.write(w, header)
            if refused is None:
                assert Channel(r, key, max_frame=limit).recv() == "x" * 100
            else:
                with pytest.raises(ProtocolError, match=refused):
                    Channel(r, key, max_frame=limit).recv()
        finally:
            os.close(r)
            os.close(w)


def _join_cli(*args: str, env: dict[str, str] | None = None,
              stdin: int = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}
    return subprocess.run([sys.executable, "-m", "elastic_magic.cli", "join", *args],
                          env={**clean, **(env or {})}, stdin=stdin, capture_output=True,
                          text=True, timeout=60)


def test_a_token_on_the_command_line_is_refused_and_says_what_to_do():
    done = _join_cli("127.0.0.1:29400", "--token", "3f1c")
    assert done.returncode == 2
    assert "visible to every user" in done.stderr and "--token-file PATH" in done.stderr


def test_a_token_file_others_can_read_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("3f1c\n")
    path.chmod(0o644)
    done = _join_cli("127.0.0.1:29400", "--token-file", str(path))
    assert done.returncode == 2 and f"chmod 600 {path}" in done.stderr, done.stderr
    if os.geteuid() == 0:  # one that another user planted, 0600 or not, is not the job's
        path.chmod(0o600)
        os.chown(path, 65534, 65534)
        done = _join_cli("127.0.0.1:29400", "--token-file", str(path))
        assert done.returncode == 2 and "belongs to user id 65534" in done.stderr, done.stderr


def test_machines_join_with_a_token_file_or_at_a_prompt(tmp_path, log_dir, recorder):
    spec = em.JobSpec.create(1, nnodes="1:3", log_dir=log_dir, timeout=120)
    job = Job(spec, build_payload(SLEEPER, spec, namespace={})).start()
    procs: list[subprocess.Popen[bytes]] = []
    outcome: dict[str, object] = {}

    def join(*extra: str, stdin: int) -> subprocess.Popen[bytes]:
        endpoint = recorder.of(AcceptingNodes)[0].endpoint
        clean = {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"}
        out = (tmp_path / f"node{len(procs)}.out").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_magic.cli", "join", endpoint, *extra,
             "--log-dir", str(tmp_path / f"node{len(procs)}-logs")],
            env=clean, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        out.close()
        procs.append(proc)
        return proc

    def drive() -> None:
        until(lambda: "up" in recorder.lines(0) or job.done, 60)
        assert job.token is not None
        path = tmp_path / "token"
        path.write_text(job.token + "\n")
        path.chmod(0o600)
        join("--token-file", str(path), stdin=subprocess.DEVNULL)
        # At a terminal it asks; here the terminal is a pseudo-terminal we type into.
        master, slave = pty.openpty()
        try:
            join(stdin=slave)
            # Typed once it asks: turning echo off flushes what was typed before.
            prompt = tmp_path / f"node{len(procs) - 1}.out"
            until(lambda: "job token" in prompt.read_text(), 60)
            os.write(master, (job.token + "\n").encode())
            # Both proved the token and took part in a round (a stop while a machine is
            # still opening the rendezvous would end it with a connection error instead).
            until(lambda: any(r.nnodes == 3 for r in recorder.of(RendezvousCompleted))
                  or job.done, 120)
            outcome["cmdlines"] = [" ".join(psutil.Process(p.pid).cmdline()) for p in procs]
        finally:
            os.close(slave)
            job.stop()
            outcome["codes"] = [p.wait(timeout=60) for p in procs]
            os.close(master)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    try:
        result = job.wait(recorder)
        thread.join(timeout=120)
    finally:
        for proc in procs:  # ours, by PID, if a wait above gave up
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [(tmp_path / f"node{i}.out").read_text() for i in range(len(procs))]
    assert result.state is em.JobState.STOPPED
    assert sum(e.connected for e in recorder.of(NodeConnected)) == 2, outputs
    assert "job token" in outputs[1]  # the prompt
    assert outcome["codes"] == [0, 0], outputs
    assert job.token and not any(job.token in c for c in outcome["cmdlines"])  # type: ignore[union-attr]


@pytest.mark.unit
def test_the_join_command_the_notebook_shows_names_a_private_token_file_not_the_token(
        tmp_path):
    """A notebook's outputs are saved and shared: the command it shows names a file only
    the user can read, never the token; where no private file can be made, it says where
    the token is instead of printing it. The file goes with the job."""
    from elastic_magic.agent.machines.token_file import TokenFile

    token = "3f1c" * 8
    held = TokenFile("em-run", token, folder=tmp_path / "tokens")
    command = held.command("10.0.0.5:29400")
    assert held.path is not None and token not in command
    assert command == f"elastic-magic join 10.0.0.5:29400 --token-file {held.path}"
    assert held.path.read_text() == token
    assert stat.S_IMODE(held.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(held.path.parent.stat().st_mode) == 0o700
    held.remove()
    assert list((tmp_path / "tokens").iterdir()) == []
    # A folder others can read, or a link planted where the folder would be: no file.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    (tmp_path / "planted").symlink_to(shared)
    for folder in (shared, tmp_path / "planted"):
        refused = TokenFile("em-run", token, folder=folder)
        command = refused.command("10.0.0.5:29400")
        assert refused.path is None and token not in command, command
        assert "`job.token`" in command and str(shared) in command, command
    assert list(shared.iterdir()) == []


@pytest.mark.unit
def test_a_token_file_a_killed_kernel_left_is_removed_by_the_next_job(tmp_path):
    """A kernel SIGKILLed mid-job leaves its token file (a dead job's key). The next job on
    the host removes those of this host's processes that are gone, or whose pid now names
    another process; a live job's file, another host's (a home folder a cluster shares)
    and any other file stay."""
    from elastic_magic.agent.machines import token_file
    from elastic_magic.agent.machines.token_file import TokenFile

    folder = tmp_path / "tokens"
    live = TokenFile("em-live", "a" * 32, folder=folder)
    assert live.path is not None
    host = token_file._HOST  # its name and pid namespace
    assert host.startswith(socket.gethostname() + "+")
    gone = int(Path("/proc/sys/kernel/pid_max").read_text())  # never a process's pid
    mine = token_file._process_mark(os.getpid())
    stale = [f"em-dead-0123abcd.{gone}.77@{host}",
             f"em-reused-0123abcd.{os.getpid()}.1@{host}"]  # this pid, another start
    kept = [f"em-far-0123abcd.{gone}.77@another-host", "notes.txt"]
    for name in stale + kept:
        (folder / name).write_text("x")
    assert live.path.name.endswith(f".{mine}@{host}")
    TokenFile("em-next", "b" * 32, folder=folder)
    left = {p.name for p in folder.iterdir()}
    assert not left & set(stale)
    assert set(kept) | {live.path.name} <= left and len(left) == len(kept) + 2


@pytest.mark.unit
def test_a_worker_store_address_replayed_from_an_earlier_round_is_refused(monkeypatch):
    """The head signs each round's worker-store address for that round only: someone who
    copies round 0's signed value (an old store's port, which another user may hold by now)
    into round 1's key gets the job ended, not its workers."""
    from elastic_magic.agent.machines import rendezvous as rdzv
    from elastic_magic.wire.protocol import new_secret

    rendezvous = rdzv.Rendezvous(f"em-replay-{os.getpid()}", key=new_secret())
    try:
        first = rendezvous.next_round(1)
        prefix = f"torch.rendezvous.{rendezvous.run_id}"
        old = rendezvous.store.get(f"{prefix}.0/{rdzv._WORKER_STORE_KEY}")
        real_put = rdzv.put_signed

        def put_then_replay(store, key, name, value, **kwargs):
            real_put(store, key, name, value, **kwargs)
            if name == rdzv._WORKER_STORE_KEY:  # the attacker wins the race to the key
                store.set(name, old)

        monkeypatch.setattr(rdzv, "put_signed", put_then_replay)
        with pytest.raises(rdzv.RendezvousRejected, match="worker_store"):
            rendezvous.next_round(1)
        monkeypatch.setattr(rdzv, "put_signed", real_put)
        assert rendezvous.next_round(1).round_id != first.round_id  # unreplayed: it goes on
    finally:
        rendezvous.close()


# -- what the folder a job starts from holds never runs before the cell (issue 18) ----------

# Each writes the marker when imported: a module of these names in the folder a job was
# started from (a shared folder, say) must never be imported by our processes.
# sitecustomize: Python imports it while it starts, before any runner cleans the path.
PLANTED = ("cloudpickle", "torch", "numpy", "elastic_magic", "sitecustomize")
PLANT = "open({marker!r}, 'a').write(__name__ + ' imported from ' + __file__ + '\\n')\n"
# The kernel: a script from elsewhere, run in the planted folder, with a copy of
# elastic_magic of its own. Its own imports done, the current directory goes first on its
# path, as in a Jupyter kernel and `elastic-magic join`; and the workers' PYTHONPATH gets an
# empty and a relative entry (`export PYTHONPATH=$PYTHONPATH:lib` with it unset), which
# Python turns into the current directory and a folder inside it.
KERNEL = """
import json, os, sys
log_dir, users, copy, pool = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "pool"
sys.path.insert(0, copy)
import cloudpickle, numpy, torch
import elastic_magic as em
sys.path[:0] = ["", users]
os.environ["PYTHONPATH"] = ":lib:" + os.environ.get("PYTHONPATH", "")
result = em.launch(CELL, nproc=2, backend="gloo", pool=pool, log_dir=log_dir,
                   render=lambda events: None)
print(json.dumps({"kernel": em.__file__, "ranks": result.values}), flush=True)
"""
CELL = """
import os
import cloudpickle, numpy, torch
import elastic_magic
import from_the_kernels_cwd, from_the_kernels_path
dict(cwd=os.getcwd(), modules=[from_the_kernels_cwd.VALUE, from_the_kernels_path.VALUE],
     package=elastic_magic.__file__, torch=torch.__file__)
"""


def test_our_interpreters_keep_absolute_path_entries_the_user_chose_in_the_start_folder(
        tmp_path):
    """A kernel started in the home folder with packages in ~/.local, or a project's src on
    PYTHONPATH: entries the user named absolutely stay on our interpreters' path, inside the
    start folder too; what a relative entry names does not (a shared folder's ``lib``)."""
    from elastic_magic.agent.node import interpreter

    (tmp_path / "chosen").mkdir()
    (tmp_path / "chosen" / "em_chosen.py").write_text("def main():\n    print('ran')\n")

    def run(pythonpath: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(interpreter.command("em_chosen"), cwd=tmp_path, text=True,
                              capture_output=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": pythonpath})

    chosen = run(f"{tmp_path / 'chosen'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert chosen.returncode == 0 and chosen.stdout == "ran\n", chosen.stderr
    relative = run(f"chosen{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert relative.returncode != 0 and "No module named 'em_chosen'" in relative.stderr


@pytest.mark.parametrize("runner", ["local", "remote"])
def test_a_package_planted_in_the_start_folder_never_runs_through_pythonpath_entries(
        runner, tmp_path):
    """``export PYTHONPATH=$PYTHONPATH:/opt/x`` with it unset leaves an empty entry, which
    Python turns into the start folder, as it does a relative one (``lib``) into a folder
    in it. sbatch gives the job the kernel's environment and folder: an
    ``elastic_magic/__init__.py`` planted in a group-writable notebook folder ran as the
    user on the node, where the remote runner dropped only ``-c``'s "". Both runners
    clean the path alike: the local one, and the remote one through a login's shell."""
    import shlex

    from elastic_magic.agent.node import interpreter

    start, marker = tmp_path / "start", tmp_path / "marker"
    for folder in (start, start / "lib"):
        (folder / "elastic_magic").mkdir(parents=True)
        (folder / "elastic_magic" / "__init__.py").write_text(PLANT.format(marker=str(marker)))
    start.chmod(0o775)
    args = ("elastic_magic.cli", "join", "not-an-endpoint", "--token-stdin")
    argv = interpreter.command(*args) if runner == "local" else \
        ["sh", "-c", shlex.join(interpreter.remote_command(sys.executable, *args))]
    package_parent = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(argv, cwd=start, input="token\n", capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": f":lib:{package_parent}"})
    assert not marker.exists(), marker.read_text()
    assert done.returncode == 2 and "is not HOST:PORT" in done.stderr, done.stderr


@pytest.mark.parametrize("pool", ["pool", "no-pool"])
def test_modules_planted_in_the_start_folder_never_run(pool, tmp_path, log_dir):
    """`python -m` puts the current directory first on sys.path: a `cloudpickle.py` in the
    folder a job started from ran as its user in the zygote or worker. Our interpreters
    import only from their own path, and elastic_magic from where the kernel has it (not
    the copy their path finds); the cell still gets the kernel's cwd and sys.path, and
    imports the user's modules from both."""
    shared, users, scripts = tmp_path / "shared", tmp_path / "users", tmp_path / "scripts"
    for folder in (shared, users, scripts):
        folder.mkdir()
    copy = tmp_path / "copy"
    shutil.copytree(Path(em.__file__).parent, copy / "elastic_magic",
                    ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "marker"
    for name in PLANTED:
        (shared / f"{name}.py").write_text(PLANT.format(marker=str(marker)))
        (shared / "lib").mkdir(exist_ok=True)
        (shared / "lib" / f"{name}.py").write_text(PLANT.format(marker=str(marker)))
    (shared / "from_the_kernels_cwd.py").write_text("VALUE = 'cwd'\n")
    (users / "from_the_kernels_path.py").write_text("VALUE = 'path'\n")
    script = scripts / "kernel.py"
    script.write_text(KERNEL.replace("CELL", repr(CELL)))
    done = subprocess.run([sys.executable, str(script), str(log_dir), str(users), str(copy),
                           pool], cwd=shared, capture_output=True, text=True, timeout=240)
    assert not marker.exists(), marker.read_text()
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["kernel"] == str(copy / "elastic_magic" / "__init__.py")
    assert sorted(found["ranks"]) == ["0", "1"]
    for rank in found["ranks"].values():
        assert rank["cwd"] == str(shared)
        assert rank["modules"] == ["cwd", "path"]
        assert rank["package"] == found["kernel"]  # the kernel's copy, not another one
        assert not rank["torch"].startswith(str(shared))
