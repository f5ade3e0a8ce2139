"""The key that signs checkpoints: 32 random bytes in a file only the user can read.

A checkpoint is unpickled when a job resumes from it, so it is code: the agent signs each
one it writes (HMAC-SHA256, ``agent/node/checkpoint_file.py``) and loads only one whose
signature this key verifies. Whoever cannot read the key cannot forge a checkpoint, wherever
the file lies. The key is made on first use, in ``$XDG_CONFIG_HOME/elastic_magic/`` (default
``~/.config/elastic_magic/checkpoint.key``) or the file ``$ELASTIC_MAGIC_CHECKPOINT_KEY``
names; to resume on another machine, copy the key file there (mode 0600).

The key's folder, and every folder on the way to it, must let no one else replace what it
holds (``folders.open_path``): whoever could rename the key's folder away would have the
next job make a new key, and refuse every checkpoint of the user's. A key missing where a
checkpoint is to be loaded is an error that names it, never a new key.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

from ..folders import (
    READ_FILE,
    NotPrivate,
    absolute,
    new_file,
    open_path,
    private_file_problem,
    replaceable,
)

ENV = "ELASTIC_MAGIC_CHECKPOINT_KEY"
KEY_SIZE = 32
_FIX = ("Remove it (a new key is made; checkpoints signed with the old one are then refused) "
        f"or point {ENV} at a key file of yours, mode 0600. See the Security page of the "
        "docs, docs/explanation/security.md.")


def key_path() -> Path:
    """Where the checkpoint key is: ``$ELASTIC_MAGIC_CHECKPOINT_KEY``, else the user's
    config folder."""
    if given := os.environ.get(ENV):
        return Path(given).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "elastic_magic" / "checkpoint.key"


class KeyMissing(NotPrivate):
    """There is no key where a checkpoint signed with one is to be loaded."""


def checkpoint_key(*, signed: Path | None = None) -> bytes:
    """The user's checkpoint key, made (0600, in a 0700 folder) if there is none yet,
    unless a checkpoint ``signed`` with a key is to be loaded: then a missing key raises
    KeyMissing. Raises NotPrivate, saying what to do, for a key file that is a link,
    another user's, open to others or not a key, and for a folder on the way to it in
    which others could rename it."""
    path = key_path()
    folder = key_folder(path)
    try:
        try:
            return _read(folder, path)
        except FileNotFoundError:
            if signed is not None:
                raise KeyMissing(
                    f"the checkpoint key {path} is missing, and the checkpoint {signed} is "
                    "signed with a key: it is not loaded, and no new key is made (it would "
                    "refuse it). If the key is elsewhere (moved, or on the machine that wrote "
                    f"the checkpoint), copy its key file here, or point {ENV} at it; if it is "
                    "lost, move the checkpoint away to start from scratch. See "
                    "the Security page of the docs, docs/explanation/security.md.") from None
            _create(folder, path.name)
            return _read(folder, path)
    finally:
        os.close(folder)


def key_folder(path: Path | None = None) -> int:
    """A descriptor of the key's folder, created 0700 where missing, reached without a
    folder or link on the way that others could change (``open_path``), and one in which
    no one else can replace the key. Raises NotPrivate saying what to do."""
    path = absolute(path or key_path())
    fix = (f"Keep the key below folders that only you (or root) can write: fix the modes, "
           f"or point {ENV} at a key file in such a folder. See the Security page of the "
           "docs, docs/explanation/security.md.")
    try:
        folder, where = open_path(path.parent, create=True)
    except NotPrivate as exc:
        raise NotPrivate(f"the checkpoint key {path} is not used: {exc}; whoever can do that "
                         f"can take your key away, or swap it. {fix}") from None
    problem = replaceable(os.fstat(folder))
    if problem:
        os.close(folder)
        raise NotPrivate(f"the checkpoint key {path} is not used: its folder {where} "
                         f"{problem}, so they can take the key away, or swap it. {fix}")
    return folder


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
        problem = private_file_problem(fd, path)
        if problem:
            raise NotPrivate(f"the checkpoint key is not used: {problem}; whoever can read "
                             f"it can forge checkpoints that run code in your jobs. {_FIX}")
        key = file.read(KEY_SIZE + 1)
    if len(key) != KEY_SIZE:
        raise NotPrivate(f"the checkpoint key {path} is not a key ({len(key)} bytes, not "
                         f"{KEY_SIZE}). {_FIX}")
    return key
