"""Checkpoints are signed with the user's key (HMAC-SHA256) and loaded only when the
signature checks: a forged one (another key, or none) or a tampered one is refused before
anything in it is unpickled and before any worker starts; a good one resumes. Real jobs,
real workers, the key in a config folder of the test's (conftest's ``checkpoint_config``)."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
import secrets
import stat
import struct
import subprocess
import sys

import pytest

import elastic_magic as em
from elastic_magic.agent.handles.job import AgentError
from elastic_magic.training import snapshot_format
from elastic_magic.training.checkpoint_key import ENV, checkpoint_key

CELL = """
import elastic_magic
state = elastic_magic.State(step=0, resumed_at=-1)
state.resumed_at = state.step
for step in range(state.step + 1, state.step + 3):
    state.step = step
    state.commit()
"""


class _Pwn:
    def __init__(self, canary) -> None:
        self.canary = str(canary)

    def __reduce__(self):
        return exec, (f"open({self.canary!r}, 'w').write('pwned')",)


def run(ckpt, log_dir):
    result = em.launch(CELL, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt,
                       render=lambda e: None)
    values = snapshot_format.load(io.BytesIO(result.snapshot))["values"]
    return values["resumed_at"], values["step"]


def refused(ckpt, log_dir) -> str:
    """Launch on ``ckpt``: the refusal's message; no worker was started."""
    started = set(log_dir.glob("*/group_*"))
    with pytest.raises(AgentError) as error:
        em.launch(CELL, nproc=1, log_dir=log_dir, checkpoint_dir=ckpt, render=lambda e: None)
    assert set(log_dir.glob("*/group_*")) == started  # no worker of this job started
    assert "CheckpointRefused" not in str(error.value)  # what to do, not our repr
    return str(error.value)


def key_file(config):
    return config / "elastic_magic" / "checkpoint.key"


def test_a_good_checkpoint_resumes_and_the_key_is_made_once(tmp_path, log_dir,
                                                            checkpoint_config):
    ckpt = tmp_path / "ckpt"
    assert run(ckpt, log_dir) == (0, 2)
    key = key_file(checkpoint_config)
    info = os.stat(key)
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_size == 32
    assert stat.S_IMODE(os.stat(key.parent).st_mode) == 0o700
    assert run(ckpt, log_dir) == (2, 4)
    again = os.stat(key)
    assert (again.st_ino, again.st_mtime_ns) == (info.st_ino, info.st_mtime_ns)


@pytest.mark.parametrize("change", ["a byte of the snapshot", "the step", "cut short"])
def test_a_tampered_checkpoint_is_refused(tmp_path, log_dir, change):
    ckpt = tmp_path / "ckpt"
    run(ckpt, log_dir)
    path = ckpt / "checkpoint.em"
    good = path.read_bytes()
    if change == "the step":
        assert b'"step": 2' in good
        bad = good.replace(b'"step": 2', b'"step": 9', 1)
    elif change == "cut short":
        bad = good[:-7]
    else:
        at = len(good) - 32 - 3  # in the snapshot, just before the tag
        bad = good[:at] + bytes([good[at] ^ 1]) + good[at + 1:]
    path.write_bytes(bad)
    message = refused(ckpt, log_dir)
    assert "is not loaded" in message and "does not match your key" in message, message
    path.write_bytes(good)  # the job that wrote it resumes from it
    assert run(ckpt, log_dir) == (2, 4)


def test_a_checkpoint_written_with_another_key_is_refused(tmp_path, log_dir, monkeypatch):
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere" / "other.key"))  # another machine's
    assert run(ckpt, log_dir) == (0, 2)
    monkeypatch.delenv(ENV)
    checkpoint_key()  # this machine's own key (a missing one is refused: test_checkpoint_folders)
    message = refused(ckpt, log_dir)
    assert "written with another key" in message and "copy its key file" in message
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere" / "other.key"))  # the key copied
    assert run(ckpt, log_dir) == (2, 4)


@pytest.mark.unit
@pytest.mark.parametrize("signature", ["another key's", "none (an earlier version's)"])
def test_a_forged_checkpoint_is_never_unpickled(tmp_path, log_dir, signature):
    ckpt, canary = tmp_path / "ckpt", tmp_path / "canary"
    ckpt.mkdir(mode=0o700)
    table = pickle.dumps(_Pwn(canary))  # what loading the snapshot unpickles first
    snapshot = snapshot_format.MAGIC + struct.pack("<Q", len(table)) + table
    meta = json.dumps({"step": 7, "world_size": 1}).encode()
    magic = b"EMCKPT02" if signature == "another key's" else b"EMCKPT01"
    data = magic + struct.pack("<Q", len(meta)) + meta + snapshot
    if magic == b"EMCKPT02":
        data += hmac.new(secrets.token_bytes(32), data, hashlib.sha256).digest()
    fd = os.open(ckpt / "checkpoint.em", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    checkpoint_key()  # the user's own (a missing one is refused: test_checkpoint_folders)
    message = refused(ckpt, log_dir)
    expected = "does not match your key" if magic == b"EMCKPT02" else "without a signature"
    assert expected in message and "docs/explanation/security.md" in message, message
    assert not canary.exists()


@pytest.mark.parametrize("problem", ["readable by others", "a link"])
def test_a_key_file_others_could_read_or_swap_is_refused(tmp_path, log_dir,
                                                         checkpoint_config, problem):
    ckpt = tmp_path / "ckpt"
    run(ckpt, log_dir)
    key = key_file(checkpoint_config)
    if problem == "a link":
        os.rename(key, tmp_path / "moved.key")
        key.symlink_to(tmp_path / "moved.key")
    else:
        os.chmod(key, 0o644)
    message = refused(ckpt, log_dir)
    expected = "is a symbolic link" if problem == "a link" else "open to other users (mode 644)"
    assert "checkpoint key" in message and expected in message, message


def test_two_first_uses_at_once_end_with_one_key(tmp_path, checkpoint_config):
    code = ("from elastic_magic.training.checkpoint_key import checkpoint_key; "
            "print(checkpoint_key().hex())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              text=True) for _ in range(6)]
    keys = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert len(keys) == 1 and bytes.fromhex(keys.pop()) == key_file(checkpoint_config).read_bytes()
    assert [p.name for p in key_file(checkpoint_config).parent.iterdir()] == ["checkpoint.key"]
