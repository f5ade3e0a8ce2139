"""The checkpoint folder and the key on a machine shared with others: another user (a real
process of uid 65534) who can write a folder on the way cannot redirect --checkpoint-dir
through a link, nor swap another of the victim's folders (an older checkpoint) into its
place, nor take the key away so that a new one is made. Real jobs, real workers."""

from __future__ import annotations

import errno
import io
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import Recorder
from test_signed_checkpoints import CELL  # resumes at its last commit, commits two steps

import elastic_magic as em
from elastic_magic.agent.handles.job import AgentError
from elastic_magic.agent.node import checkpoint_file
from elastic_magic.training import snapshot_format
from elastic_magic.ui.describe import describe
from elastic_magic.wire.events import CheckpointMoved, CheckpointVanished

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")



@pytest.fixture
def shared():
    """A folder other users can reach (tmp_path's parents are root's alone), root's, and
    closed to their writes: the place for a team's folder in these tests."""
    path = Path(tempfile.mkdtemp(prefix="em-shared-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def as_nobody(script: str) -> None:
    """Run ``script`` (sh) as another user: uid and gid 65534, no other group."""
    subprocess.run(["sh", "-ec", script], user=NOBODY, group=NOBODY, extra_groups=[],
                   cwd="/", check=True)


def run(ckpt, log_dir, render=lambda e: None, **options):
    """Run CELL on ``ckpt``: the step it resumed at, the step it ended at."""
    result = em.launch(CELL, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt, render=render,
                       **options)
    values = snapshot_format.load(io.BytesIO(result.snapshot))["values"]
    return values["resumed_at"], values["step"]


def refused(ckpt, log_dir, **options) -> str:
    """Launch on ``ckpt``: the agent's refusal, before any worker started."""
    started = set(log_dir.glob("*/group_*"))
    with pytest.raises(AgentError) as error:
        em.launch(CELL, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt, render=lambda e: None,
                  **options)
    assert set(log_dir.glob("*/group_*")) == started  # no worker of this job started
    assert "CheckpointRefused" not in str(error.value) and "NotPrivate" not in str(error.value)
    return str(error.value)


def spec_error(ckpt, log_dir, **options) -> str:
    """Launch on ``ckpt``: the usage error, before anything started."""
    started = set(log_dir.iterdir())
    with pytest.raises(em.SpecError) as error:
        em.launch(CELL, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt, render=lambda e: None,
                  **options)
    assert set(log_dir.iterdir()) == started  # no job started
    return str(error.value)


def step_of(ckpt: Path) -> int:
    return checkpoint_file.split((ckpt / "checkpoint.em").read_bytes())[0]["step"]


# -- links and folders on the way --------------------------------------------------------

@root_only
@pytest.mark.parametrize("team_mode", [0o1777, 0o777], ids=["sticky", "not sticky"])
def test_a_link_another_user_made_is_never_followed(shared, tmp_path, log_dir, team_mode):
    important = tmp_path / "important-exp"  # the victim's other experiment
    important.mkdir(mode=0o700)
    assert run(important, log_dir) == (0, 2)
    kept = (important / "checkpoint.em").read_bytes()
    team = shared / "team"
    team.mkdir()
    os.chmod(team, team_mode)
    # She cannot read the victim's folder, nor write it: she only names it.
    as_nobody(f"ln -s {important} {team}/new-exp")
    for trusting in ({}, {"checkpoint_shared": True}):
        message = spec_error(team / "new-exp", log_dir, **trusting)
        assert f"{team}/new-exp is a symbolic link (to {important}) that user id {NOBODY} " \
               "made, not you: it is not followed" in message, message
    assert (important / "checkpoint.em").read_bytes() == kept  # neither resumed nor written


@root_only
def test_a_folder_on_the_way_that_others_can_change_is_refused_unless_trusted(
        shared, tmp_path, log_dir):
    sticky, team, hers = shared / "tmp", shared / "team", shared / "hers"
    for folder, mode in ((sticky, 0o1777), (team, 0o777), (hers, 0o755)):
        folder.mkdir()
        os.chmod(folder, mode)
    os.chown(hers, NOBODY, NOBODY)
    assert run(sticky / "exp", log_dir) == (0, 2)  # /tmp's way: others cannot rename it
    own_link = tmp_path / "link"  # the user's own link, in a folder only they can write
    own_link.symlink_to(sticky / "exp")
    assert run(own_link, log_dir) == (2, 4)
    for folder, problem in ((team, "can be written by other users (mode 777, without the "
                                   "sticky bit)"),
                            (hers, f"belongs to user id {NOBODY}")):
        message = spec_error(folder / "exp", log_dir)
        assert f"the folder {folder} on the way {problem}" in message, message
        assert "--checkpoint-shared" in message
        # the exact command, where the folder is the user's to change
        fix = f"(`chmod go-w {folder}` if no one else needs to write there; if others do, " \
            f"`chmod +t {folder}` lets them replace only what is theirs)"
        assert (fix in message) == (folder == team), message
        assert not (folder / "exp").exists()  # nothing made there
        assert run(folder / "exp", log_dir, checkpoint_shared=True) == (0, 2)
    # Trusted or not, a link in a folder others can write is not followed: any of them
    # could have made it, or changed it since.
    (team / "link").symlink_to(sticky / "exp")
    message = spec_error(team / "link", log_dir, checkpoint_shared=True)
    assert f"{team}/link is a symbolic link (to {sticky}/exp) in {team}, which can be " \
           "written by other users" in message, message


# -- an older checkpoint of the user's in the folder's place ------------------------------

@root_only
def test_a_folder_on_the_way_that_can_be_passed_but_not_listed_is_no_obstacle(shared):
    """A parent such as a cluster's /scratch at mode 0711 lets a user reach their folder
    in it without listing it: the walk from / opens each folder on the way only to go
    through it (before, it asked to read each one, and refused the user's own folder)."""
    scratch = shared / "scratch"
    scratch.mkdir(mode=0o711)
    os.chmod(scratch, 0o711)
    mine = scratch / "nobody"
    mine.mkdir(mode=0o700)
    os.chown(mine, NOBODY, NOBODY)
    script = ("import sys; from pathlib import Path; from elastic_magic.folders import "
              "own_path; fd, real = own_path(Path(sys.argv[1]) / 'ckpt', create=True); "
              "print(real)")
    package_parent = str(Path(em.__file__).resolve().parents[1])
    # The system's interpreter: the tests' may live in root's home, which others cannot enter.
    done = subprocess.run(["/usr/bin/python3", "-c", script, str(mine)], user=NOBODY,
                          group=NOBODY, extra_groups=[], cwd="/", capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": package_parent})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(mine / "ckpt")
    assert (mine / "ckpt").stat().st_uid == NOBODY


@root_only
@pytest.mark.parametrize("old", ["the folder renamed", "a folder of its own"])
def test_another_users_swap_of_two_checkpoint_folders_is_refused(shared, log_dir, old):
    team = shared / "team"  # a team's folder, trusted with --checkpoint-shared
    team.mkdir()
    os.chmod(team, 0o777)
    trust = {"checkpoint_shared": True}
    ckpt, ckpt_old = team / "ckpt", team / "ckpt-old"
    if old == "the folder renamed":  # the user started afresh, keeping the old one aside
        assert run(ckpt, log_dir, **trust) == (0, 2)
        os.rename(ckpt, ckpt_old)
    else:
        assert run(ckpt_old, log_dir, **trust) == (0, 2)
    for expected in ((0, 2), (2, 4), (4, 6)):
        assert run(ckpt, log_dir, **trust) == expected
    as_nobody(f"cd {team}; mv ckpt swap; mv ckpt-old ckpt; mv swap ckpt-old")
    assert (step_of(ckpt), step_of(ckpt_old)) == (2, 6)
    message = refused(ckpt, log_dir, **trust)
    assert f"the checkpoint {ckpt}/checkpoint.em is not loaded" in message, message
    if old == "the folder renamed":  # its seal says team/ckpt: the record tells them apart
        assert f"{ckpt} held another folder of yours when a checkpoint was last written " \
               "there" in message, message
    else:
        assert f"its folder was at {ckpt_old} when it was written" in message, message
    assert "--checkpoint-moved" in message and "find where your folder went" in message
    assert (step_of(ckpt), step_of(ckpt_old)) == (2, 6)  # nothing written over
    as_nobody(f"cd {team}; mv ckpt swap; mv ckpt-old ckpt; mv swap ckpt-old")  # put back
    assert run(ckpt, log_dir, **trust) == (6, 8)


def test_an_older_copy_put_back_is_refused_unless_the_user_says_so(tmp_path, log_dir):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    older = (ckpt / "checkpoint.em").read_bytes()
    assert run(ckpt, log_dir) == (2, 4)
    os.unlink(ckpt / "checkpoint.em")
    (ckpt / "checkpoint.em").write_bytes(older)  # a backup restored
    message = refused(ckpt, log_dir)
    # Each run writes one checkpoint per commit, or fewer (a write skips one superseded).
    numbers = re.search(r"it is older than the last checkpoint this folder held \(it is its "
                        r"checkpoint (\d+), and (\d+) was written since\)", message)
    assert numbers and int(numbers[1]) < int(numbers[2]), message
    assert "--checkpoint-moved" in message
    assert run(ckpt, log_dir, checkpoint_moved=True) == (2, 4)  # the user restored it
    assert run(ckpt, log_dir) == (4, 6)  # and it is the folder's latest now


def test_a_folder_the_user_moved_resumes_with_checkpoint_moved(tmp_path, log_dir):
    ckpt, moved = tmp_path / "ckpt", tmp_path / "elsewhere" / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    moved.parent.mkdir()
    os.rename(ckpt, moved)
    # Where the folder was, a job starts from scratch, saying that a checkpoint was written
    # there: it may not be the user who moved it (an empty folder put in its place).
    recorder = Recorder()
    assert run(ckpt, log_dir, render=recorder) == (0, 2)
    (vanished,) = recorder.of(CheckpointVanished)
    assert vanished.path == str(ckpt) and vanished.counter >= 1
    headline = describe(vanished)
    assert headline is not None and f"--checkpoint-dir {ckpt} holds no checkpoint, but its " \
        f"checkpoint {vanished.counter} was written there on " in headline.text
    assert "starting from scratch. If you removed or moved it, nothing is wrong" \
        in headline.text
    recorder = Recorder()
    assert run(ckpt, log_dir, render=recorder) == (2, 4)
    assert not recorder.of(CheckpointVanished)  # it holds a checkpoint of its own now
    message = refused(moved, log_dir)
    assert f"its folder was at {ckpt} when it was written" in message, message
    assert "If you did that yourself, resume with --checkpoint-moved" in message
    recorder = Recorder()
    assert run(moved, log_dir, render=recorder, checkpoint_moved=True) == (2, 4)
    (taken,) = recorder.of(CheckpointMoved)  # it says what it let through
    assert taken.overlooked and f"its folder was at {ckpt}" in taken.overlooked
    assert "Take the flag off the cell" in describe(taken).text
    assert run(moved, log_dir) == (4, 6)
    recorder = Recorder()  # a flag left on the cell: it says that it was not needed
    assert run(moved, log_dir, render=recorder, checkpoint_moved=True) == (6, 8)
    (taken,) = recorder.of(CheckpointMoved)
    assert taken.overlooked is None
    assert describe(taken).text.startswith("--checkpoint-moved was not needed")
    copy = tmp_path / "copy"  # the file alone, into another folder
    copy.mkdir()
    shutil.copy(moved / "checkpoint.em", copy / "checkpoint.em")
    message = refused(copy, log_dir)
    assert f"it was written in another folder (then at {moved})" in message, message


def test_a_checkpoint_of_the_version_before_is_refused_saying_what_to_do(
        tmp_path, log_dir, checkpoint_config):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    # As the version before wrote it: signed, but without the folder's seal.
    meta, snapshot = checkpoint_file.split((ckpt / "checkpoint.em").read_bytes())
    del meta["folder"]
    key = (checkpoint_config / "elastic_magic" / "checkpoint.key").read_bytes()
    os.unlink(ckpt / "checkpoint.em")
    fd = os.open(ckpt / "checkpoint.em", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        checkpoint_file.write(fd, key, meta, snapshot, len(snapshot))
    finally:
        os.close(fd)
    message = refused(ckpt, log_dir)
    assert "written by an earlier version of elastic_magic, which did not tie a checkpoint " \
           "to its folder" in message, message
    assert "resume from it once with --checkpoint-moved" in message
    assert run(ckpt, log_dir, checkpoint_moved=True) == (2, 4)
    assert run(ckpt, log_dir) == (4, 6)


# -- the key's folder ----------------------------------------------------------------------

@root_only
@pytest.mark.parametrize("where", ["the config folder", "a folder above it"])
def test_a_key_another_user_could_take_away_is_not_replaced(shared, tmp_path, log_dir,
                                                            monkeypatch, where):
    team = shared / "team"
    config = team / "config"
    config.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    # The folder she can write: the config folder itself, or the team's folder above it.
    writable = config if where == "the config folder" else team
    os.chmod(writable, 0o777)
    if where == "the config folder":
        as_nobody(f"mv {config}/elastic_magic {config}/taken")
    else:
        as_nobody(f"mv {config} {team}/taken")
    message = refused(ckpt, log_dir)
    key = config / "elastic_magic" / "checkpoint.key"
    assert f"the checkpoint key {key} is not used" in message, message
    assert f"{writable} " in message and "can be written by other users (mode 777" in message
    assert not key.exists()  # no new key was made


@root_only
def test_a_key_folder_another_user_made_is_refused(shared, tmp_path, log_dir, monkeypatch):
    config = shared / "config"  # as /tmp: others may create what is theirs
    config.mkdir()
    os.chmod(config, 0o1777)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    as_nobody(f"mkdir -m 777 {config}/elastic_magic")  # hers, before the user's first job
    message = refused(tmp_path / "ckpt", log_dir)
    assert f"its folder {config}/elastic_magic belongs to user id {NOBODY}" in message, message
    assert not os.listdir(config / "elastic_magic")


def test_a_missing_key_where_a_checkpoint_is_signed_is_an_error_not_a_new_key(
        tmp_path, log_dir, checkpoint_config):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    key = checkpoint_config / "elastic_magic" / "checkpoint.key"
    os.rename(key, tmp_path / "moved.key")
    message = refused(ckpt, log_dir)
    assert f"the checkpoint key {key} is missing, and the checkpoint {ckpt}/checkpoint.em " \
           "is signed with a key" in message, message
    assert "copy its key file here" in message and not key.exists()
    os.rename(tmp_path / "moved.key", key)
    assert run(ckpt, log_dir) == (2, 4)


@pytest.mark.unit
def test_a_file_system_without_hard_links_still_gets_one_folder_id(tmp_path, monkeypatch):
    """gcsfuse, s3fs and SMB mounts refuse link(2): the id is then written in place, and a
    job that meets it half written (another job writing it) waits for the rest."""
    from elastic_magic.agent.node import checkpoint_folder

    def no_links(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(checkpoint_folder.os, "link", no_links)
    first = checkpoint_folder.CheckpointFolder(tmp_path / "ckpt")
    second = checkpoint_folder.CheckpointFolder(tmp_path / "ckpt")
    assert first.id == second.id and re.fullmatch("[0-9a-f]{32}", first.id)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["checkpoint-folder.id"]  # no leftovers
    first.close()
    second.close()

    other = tmp_path / "other"  # the id met while another job writes it
    other.mkdir(mode=0o700)
    (other / "checkpoint-folder.id").write_bytes(b"0123456789abcdef")
    os.chmod(other / "checkpoint-folder.id", 0o600)
    timer = threading.Timer(0.2, lambda: (other / "checkpoint-folder.id").write_bytes(
        b"0123456789abcdef" * 2))
    timer.start()
    try:
        late = checkpoint_folder.CheckpointFolder(other)
    finally:
        timer.join()
    assert late.id == "0123456789abcdef" * 2
    late.close()
