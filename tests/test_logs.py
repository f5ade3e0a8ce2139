"""Logs on shared machines: a private default folder (checked, never another user's), private
run folders and files whatever the umask, and pruning of the default folder; another user
who can write where a job writes (a shared log folder, a checkpoint folder) gets nothing."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import stat
import struct
import subprocess
import sys
import tempfile
import time

import pytest

import elastic_magic as em
from elastic_magic import logs
from elastic_magic.agent.handles.job import AgentError
from elastic_magic.training import snapshot_format
from elastic_magic.wire.events import JobState
from elastic_magic.wire.payload import build_payload

NOBODY = 65534
DAY = 24 * 3600


@pytest.fixture
def home(tmp_path, monkeypatch):
    """Where the default log folder goes: $XDG_CACHE_HOME, and a temp dir of our own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.unit
def test_default_folder_is_private_in_the_users_cache(home):
    spec = em.JobSpec.create(1)
    assert spec.log_dir == home / "cache" / "elastic_magic" / "logs"
    assert mode(spec.log_dir.parent) == 0o700 and mode(spec.log_dir) == 0o700
    assert em.JobSpec.create(1).log_dir == spec.log_dir  # found again, as it was left


@pytest.mark.unit
def test_temp_dir_when_the_cache_cannot_be_created(home, monkeypatch):
    (home / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "not-a-folder" / "cache"))
    log_dir = em.JobSpec.create(1).log_dir
    assert log_dir == home / "tmp" / f"elastic_magic-{os.getuid()}" / "logs"
    assert mode(log_dir.parent) == 0o700 and mode(log_dir) == 0o700


@pytest.mark.unit
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
@pytest.mark.parametrize("where", ["cache", "temp dir"])
def test_a_default_folder_another_user_owns_is_refused(home, monkeypatch, where):
    if where == "cache":
        planted = home / "cache" / "elastic_magic"
    else:  # the cache cannot be created, and another user made <tmp>/elastic_magic-<uid>
        (home / "not-a-folder").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(home / "not-a-folder" / "cache"))
        planted = home / "tmp" / f"elastic_magic-{os.getuid()}"
    planted.mkdir(parents=True, mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(em.SpecError) as err:
        em.JobSpec.create(1)
    message = str(err.value)
    assert f"{planted} belongs to user id {NOBODY}, not to you" in message
    assert "--log-dir DIR" in message
    with pytest.raises(em.SpecError, match="belongs to user id"):
        em.launch("x = 1", nproc=1, render=lambda e: None)  # nothing starts
    assert not any(planted.iterdir())


@pytest.mark.unit
def test_a_default_folder_open_to_others_is_refused(home):
    folder = home / "cache" / "elastic_magic"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o755)
    with pytest.raises(em.SpecError, match=f"open to other users \\(mode 755\\). Run `chmod "
                                           f"700 {folder}`"):
        em.JobSpec.create(1)


@pytest.mark.unit
def test_a_link_planted_as_the_default_folder_is_refused(home):
    target = home / "elsewhere"
    target.mkdir(mode=0o700)
    (home / "cache").mkdir()
    (home / "cache" / "elastic_magic").symlink_to(target)
    with pytest.raises(em.SpecError, match="is a symbolic link"):
        em.JobSpec.create(1)


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_run_folders_and_files_are_private_whatever_the_umask(log_dir, mask):
    with umask(mask):
        result = em.launch("print('secret')", nproc=2, log_dir=log_dir, render=lambda e: None)
    run = log_dir / result.run_id
    for folder in (run, run / "group_0", run / "group_0" / "rank_0"):
        assert mode(folder) == 0o700, folder
    for rank in (0, 1):
        for stream in ("stdout", "stderr"):
            assert mode(result.log_path(rank, stream)) == 0o600
    assert result.log_path(0).read_text() == "secret\n"


def make_runs(folder, count: int, newest: float) -> list:
    """``count`` finished runs, a minute apart, the newest changed at ``newest``."""
    runs = []
    for i in range(count):
        run = folder / f"em-{i:012x}"
        (run / "group_0" / "rank_0").mkdir(parents=True)
        (run / "group_0" / "rank_0" / "stdout.log").write_text("old output\n")
        changed = newest - (count - 1 - i) * 60
        os.utime(run, (changed, changed))
        runs.append(run)
    return runs


@pytest.mark.unit
def test_pruning_keeps_the_newest_recent_runs_and_runs_still_written(tmp_path):
    now = time.time()
    runs = make_runs(tmp_path, 8, newest=now)
    stale = tmp_path / "em-stale"  # recent enough by rank, but changed 8 days ago
    stale.mkdir()
    os.utime(stale, (now - 8 * DAY, now - 8 * DAY))
    (tmp_path / "notes").mkdir()  # not a run: never touched
    (tmp_path / "em-a-file").write_text("")
    os.chmod(runs[0], 0o700)
    held = logs.RunFolder.open(runs[0], fresh=False)  # an old run, but a job still writes it
    try:
        removed = logs.prune(tmp_path, keep=5, days=7)
    finally:
        held.close()
    assert sorted(removed) == sorted([runs[1], runs[2], stale])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {runs[0].name, *(r.name for r in runs[3:]), "notes", "em-a-file"}
    assert logs.prune(tmp_path, keep=5, days=7) == [runs[0]]  # that job has ended


def test_jobs_prune_the_default_folder_only(home, log_dir):
    default = em.JobSpec.create(1).log_dir
    make_runs(default, logs.KEEP_RUNS + 5, newest=time.time() - 60)
    make_runs(log_dir, logs.KEEP_RUNS + 5, newest=time.time() - 60)
    ran = em.launch("x = 1", nproc=1, render=lambda e: None)
    runs = {p.name for p in default.iterdir()}
    assert len(runs) == logs.KEEP_RUNS and ran.run_id in runs
    assert not runs & {f"em-{i:012x}" for i in range(6)}  # the six oldest went
    em.launch("x = 1", nproc=1, log_dir=log_dir, render=lambda e: None)
    assert len(list(log_dir.iterdir())) == logs.KEEP_RUNS + 6  # a folder given: untouched


def test_a_running_job_is_never_pruned(home):
    spec = em.JobSpec.create(1)
    job = em.Job(spec, build_payload("import time\ntime.sleep(600)", spec)).start()
    try:
        deadline = time.monotonic() + 60
        while job.state is not JobState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        long_ago = time.time() - 30 * DAY
        os.utime(job.log_dir, (long_ago, long_ago))  # a job running for a month
        make_runs(spec.log_dir, logs.KEEP_RUNS + 1, newest=time.time() - 60)
        em.launch("x = 1", nproc=1, render=lambda e: None)
        assert job.log_dir.is_dir()
        assert len(list(spec.log_dir.iterdir())) == logs.KEEP_RUNS + 1
    finally:
        job.stop()
        job.wait()
    assert logs.prune(spec.log_dir) == [job.log_dir]  # once it has ended


# -- another local user and the folders a job writes into --------------------------------

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
VICTIM_TEXT = "the victim's own file\n"

# What the attacker leaves where a job will write: her folders and log files, open to all,
# and links to a 0600 file of the victim's where the job writes stderr and error files.
PLANT = '''
import os

def plant(run, victim, owner=65534):
    for group in range(4):
        for rank in range(4):
            folder = os.path.join(run, f"group_{group}", f"rank_{rank}")
            os.makedirs(folder)
            open(os.path.join(folder, "stdout.log"), "w").close()
            for name in ("stderr.log", "error.json"):
                os.symlink(victim, os.path.join(folder, name))
    for top, folders, files in os.walk(run):
        os.chmod(top, 0o777)
        os.chown(top, owner, owner)
        for name in files:
            path = os.path.join(top, name)
            if os.path.islink(path):
                os.lchown(path, owner, owner)
            else:
                os.chmod(path, 0o666)
                os.chown(path, owner, owner)
'''
planting: dict = {}
exec(PLANT, planting)


def victim_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    os.chmod(victim, 0o600)
    return victim


def assert_only_planted(run, victim) -> None:
    """The attacker's folder holds what she planted, as she left it (nothing of the job's
    reached her files), and the victim's file is whole."""
    found = {}
    for top, folders, files in os.walk(run):
        for name in [*folders, *files]:
            found[os.path.join(top, name)] = os.lstat(os.path.join(top, name))
    assert len(found) == 4 + 16 + 16 * 3
    for path, info in found.items():
        assert info.st_uid == NOBODY, path
        if path.endswith("stdout.log"):
            assert info.st_size == 0, path
        elif path.endswith((".log", ".json")):
            assert os.readlink(path) == str(victim)
    assert victim.read_text() == VICTIM_TEXT and mode(victim) == 0o600


@root_only
def test_a_run_folder_planted_in_a_shared_log_dir_is_refused_by_a_joining_machine(
        tmp_path, log_dir, recorder):
    from test_multinode import Machines, run_head

    shared = tmp_path / "shared"  # writable by all, as /tmp
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = victim_file(tmp_path)
    machines = Machines(tmp_path)
    joined: list = []

    def join(folder):
        out = (tmp_path / f"join{len(joined)}.out").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic_magic.cli", "join", machines.endpoint,
             "--nproc", "1", "--log-dir", str(folder)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path,
            env={**os.environ, "ELASTIC_MAGIC_TOKEN": machines.token})
        out.close()
        machines.procs.append(proc)
        joined.append(proc)
        return proc

    def drive(job):
        while machines.endpoint is None:
            time.sleep(0.05)
        # The attacker read the run id (the rendezvous store holds it) and got there first.
        planting["plant"](str(shared / job.run_id), str(victim))
        join(shared).wait(timeout=60)
        join(log_dir)  # another machine of the job on this host, in the head's folder

    spec = em.JobSpec.create(1, nnodes=2, log_dir=log_dir, timeout=120)
    try:
        result = run_head(spec, "import os\nprint('secret of rank', os.environ['RANK'])",
                          recorder, machines, drive=drive)
    finally:
        machines.reap()
    refused = (tmp_path / "join0.out").read_text()
    assert joined[0].returncode == 1, refused
    assert "the run's log folder is not this job's" in refused
    assert f"belongs to user id {NOBODY}" in refused and "--log-dir DIR" in refused
    assert_only_planted(shared / result.run_id, victim)
    assert result.state is JobState.SUCCEEDED and joined[1].returncode == 0
    for rank in (0, 1):  # both machines wrote into the run's one folder, each its own rank
        assert result.log_path(rank).read_text() == f"secret of rank {rank}\n"
        assert mode(result.log_path(rank).parent) == 0o700


RACE = PLANT + '''
import sys, time
run = os.path.join(SHARED, os.environ["TORCHELASTIC_RUN_ID"])
rank = os.environ["RANK"]
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    if rank == "0":  # the attacker, while the job runs: its folder moved, hers in its place
        os.rename(run, run + "-moved")
        plant(run, VICTIM)
        sys.exit(1)
    time.sleep(600)  # ended by the restart
print(f"rank {rank} stdout line", flush=True)
print(f"rank {rank} stderr line", file=sys.stderr, flush=True)
with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as error_file:  # as torch's @record
    error_file.write("{}")
'''


@root_only
def test_a_run_folder_renamed_and_replaced_before_a_restart_gets_nothing(
        tmp_path, recorder):
    shared = tmp_path / "proj-logs"  # a project's folder: the group may write to it
    shared.mkdir()
    os.chmod(shared, 0o2775)
    victim = victim_file(tmp_path)
    result = em.launch(RACE, nproc=2, max_restarts=1, log_dir=shared, render=recorder,
                       namespace={"SHARED": str(shared), "VICTIM": str(victim)})
    assert result.restarts == 1
    ours = shared / f"{result.run_id}-moved"
    assert_only_planted(shared / result.run_id, victim)
    assert result.log_dir == ours  # the result points at the job's own logs
    for rank in (0, 1):
        for stream in ("stdout", "stderr"):
            log = ours / "group_1" / f"rank_{rank}" / f"{stream}.log"
            assert log.read_text() == f"rank {rank} {stream} line\n"
            assert mode(log) == 0o600 and result.log_path(rank, stream) == log
        assert (ours / "group_1" / f"rank_{rank}" / "error.json").read_text() == "{}"


class _Pwn:
    """Unpickling this creates the canary file: code execution, made visible."""

    def __init__(self, canary) -> None:
        self.canary = str(canary)

    def __reduce__(self):
        return exec, (f"open({self.canary!r}, 'w').write('pwned')",)


@pytest.mark.unit
@pytest.mark.parametrize("where", ["a folder others can write", "another user's folder",
                                   "another user's file", "a link"])
def test_a_planted_checkpoint_is_never_loaded(tmp_path, log_dir, where):
    if "another user" in where and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    ckpt.mkdir(mode=0o700)
    table = pickle.dumps(_Pwn(canary))  # what loading the snapshot unpickles first
    evil = snapshot_format.MAGIC + struct.pack("<Q", len(table)) + table
    meta = json.dumps({"step": 7, "world_size": 1})
    if where == "a link":  # to a file of the user's that the attacker cannot otherwise use
        (tmp_path / "elsewhere.pt").write_bytes(evil)
        (ckpt / "snapshot.pt").symlink_to(tmp_path / "elsewhere.pt")
    else:
        (ckpt / "snapshot.pt").write_bytes(evil)
    (ckpt / "snapshot.json").write_text(meta)
    if where == "a folder others can write":
        os.chmod(ckpt, 0o777)
    elif where == "another user's folder":
        os.chown(ckpt, NOBODY, NOBODY)
    elif where == "another user's file":
        for name in ("snapshot.pt", "snapshot.json"):
            os.chown(ckpt / name, NOBODY, NOBODY)
    cell = "import elastic_magic\nstate = elastic_magic.State(step=0)"
    if "folder" in where:  # refused with the flags, before anything starts
        with pytest.raises(em.SpecError) as refused:
            em.launch(cell, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt)
        expected = "open to other users (mode 777)" if "others" in where \
            else f"belongs to user id {NOBODY}"
        assert expected in str(refused.value) and "only you can write" in str(refused.value)
    else:  # found by the agent as it opens the folder: nothing loaded, no worker started
        with pytest.raises(AgentError) as refused:
            em.launch(cell, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt, render=lambda e: None)
        expected = "is a symbolic link" if where == "a link" \
            else f"belongs to user id {NOBODY}"
        assert "not loaded" in str(refused.value) and expected in str(refused.value)
        assert "NotPrivate" not in str(refused.value)  # what to do, not our exception's repr
        assert not list(log_dir.glob("*/group_*"))
    assert not canary.exists()
