"""Logs on shared machines: a private default folder (checked, never another user's), private
run folders and files whatever the umask, and pruning of the default folder."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import time

import pytest

import elastic_magic as em
from elastic_magic import logs
from elastic_magic.events import JobState
from elastic_magic.payload import build_payload

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


def test_default_folder_is_private_in_the_users_cache(home):
    spec = em.JobSpec.create(1)
    assert spec.log_dir == home / "cache" / "elastic_magic" / "logs"
    assert mode(spec.log_dir.parent) == 0o700 and mode(spec.log_dir) == 0o700
    assert em.JobSpec.create(1).log_dir == spec.log_dir  # found again, as it was left


def test_temp_dir_when_the_cache_cannot_be_created(home, monkeypatch):
    (home / "not-a-folder").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "not-a-folder" / "cache"))
    log_dir = em.JobSpec.create(1).log_dir
    assert log_dir == home / "tmp" / f"elastic_magic-{os.getuid()}" / "logs"
    assert mode(log_dir.parent) == 0o700 and mode(log_dir) == 0o700


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


def test_a_default_folder_open_to_others_is_refused(home):
    folder = home / "cache" / "elastic_magic"
    folder.mkdir(parents=True)
    os.chmod(folder, 0o755)
    with pytest.raises(em.SpecError, match=f"open to other users \\(mode 755\\). Run `chmod "
                                           f"700 {folder}`"):
        em.JobSpec.create(1)


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


def test_pruning_keeps_the_newest_recent_runs_and_runs_still_written(tmp_path):
    now = time.time()
    runs = make_runs(tmp_path, 8, newest=now)
    stale = tmp_path / "em-stale"  # recent enough by rank, but changed 8 days ago
    stale.mkdir()
    os.utime(stale, (now - 8 * DAY, now - 8 * DAY))
    (tmp_path / "notes").mkdir()  # not a run: never touched
    (tmp_path / "em-a-file").write_text("")
    held = logs.open_run(runs[0])  # an old run, but a job still writes it
    try:
        removed = logs.prune(tmp_path, keep=5, days=7)
    finally:
        os.close(held)
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
