"""The key that signs checkpoints: 32 random bytes in a file only the user can read.

A checkpoint is unpickled when a job resumes from it, so it is code: the agent signs each
one it writes (HMAC-SHA256, ``agent/local/checkpoint_file.py``) and loads only one whose
signature this key verifies. Whoever cannot read the key cannot forge a checkpoint, wherever
the file lies. The key is made on first use, in ``$XDG_CONFIG_HOME/elastic_magic/`` (default
``~/.config/elastic_magic/checkpoint.key``) or the file ``$ELASTIC_MAGIC_CHECKPOINT_KEY``
names; to resume on another machine, copy the key file there (mode 0600).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

from .folders import READ_FILE, NotPrivate, describe, make_folders, new_file, open_folder

ENV = "ELASTIC_MAGIC_CHECKPOINT_KEY"
KEY_SIZE = 32
_FIX = ("Remove it (a new key is made; checkpoints signed with the old one are then refused) "
        f"or point {ENV} at a key file of yours, mode 0600. See README, Security.")


def key_path() -> Path:
    """Where the checkpoint key is: ``$ELASTIC_MAGIC_CHECKPOINT_KEY``, else the user's
    config folder."""
    if given := os.environ.get(ENV):
        return Path(given).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "elastic_magic" / "checkpoint.key"


def checkpoint_key() -> bytes:
    """The user's checkpoint key, made (0600, in a 0700 folder) if there is none yet. Raises
    NotPrivate, saying what to do, for a key file that is a link, another user's, open to
    others or not a key."""
    path = key_path()
    make_folders(path.parent)
    folder = open_folder(path.parent)
    try:
        try:
            return _read(folder, path)
        except FileNotFoundError:
            _create(folder, path.name)
            return _read(folder, path)
    finally:
        os.close(folder)


def _create(folder: int, name: str) -> None:
    """Write a new key whole under a temporary name, then link it to ``name``: linking
    fails where the name exists, so of two first uses at once (two kernels) one key wins
    and both read it."""
    tmp = f".{name}.{secrets.token_hex(8)}"
    fd = new_file(folder, tmp)  # 0600, O_EXCL
    try:
        os.write(fd, secrets.token_bytes(KEY_SIZE))
        os.fsync(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(fd)
        os.unlink(tmp, dir_fd=folder)


def _read(folder: int, path: Path) -> bytes:
    try:
        fd = os.open(path.name, READ_FILE | os.O_NONBLOCK, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotPrivate(f"the checkpoint key {path} is a symbolic link: it is not used. "
                             f"{_FIX}") from None
        raise
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        problem = describe(info, path, private=True) if stat.S_ISREG(info.st_mode) \
            else f"{path} is not a file"
        if problem:
            raise NotPrivate(f"the checkpoint key is not used: {problem}; whoever can read "
                             f"it can forge checkpoints that run code in your jobs. {_FIX}")
        key = file.read(KEY_SIZE + 1)
    if len(key) != KEY_SIZE:
        raise NotPrivate(f"the checkpoint key {path} is not a key ({len(key)} bytes, not "
                         f"{KEY_SIZE}). {_FIX}")
    return key
