"""What this machine remembers of each checkpoint folder, beside the key, out of anyone
else's reach: the counter of the last checkpoint each folder held, and which folder each
path held when a checkpoint was last written there. A checkpoint signed with the user's key
may still be an older one of the user's, put in the place of the latest (a folder renamed
away and another put at its name): this record tells them apart
(``agent/node/checkpoint_folder.py``).

It is ``<key>.folders`` (``checkpoint.folders`` beside ``checkpoint.key``): JSON, 0600,
replaced whole (a new file renamed over it) while a lock on the key file is held.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..folders import READ_FILE, NotPrivate, new_file, private_file_problem
from .checkpoint_key import key_folder, key_path

KEEP = 4096  # folders remembered; the ones written longest ago are forgotten first
_MAX_SIZE = 64 << 20


def ledger_name() -> str:
    return key_path().with_suffix(".folders").name


def lookup(folder_id: str, path: Path) -> tuple[int | None, str | None]:
    """The counter of the last checkpoint recorded for the folder ``folder_id`` (None: none
    recorded), and the id of the folder that ``path`` held at the last one written there."""
    with _locked() as folder:
        folders = _load(folder)
    entry = folders.get(folder_id)
    at_path = next((f for f, e in folders.items() if e.get("path") == str(path)), None)
    return (entry["counter"] if entry else None), at_path


def last_written_at(path: Path) -> tuple[int, float] | None:
    """The counter and time of the last checkpoint written at ``path`` (by whichever folder
    it held then); None if none is recorded."""
    with _locked() as folder:
        folders = _load(folder)
    entry = next((e for e in folders.values() if e.get("path") == str(path)), None)
    return (entry["counter"], entry["time"]) if entry else None


def record(folder_id: str, path: Path, counter: int, *, reset: bool = False) -> None:
    """Record the checkpoint ``counter`` as the latest of the folder ``folder_id``, at
    ``path`` (which no longer holds any other folder). ``reset``: even if it is older than
    the one recorded (the user said so)."""
    with _locked() as folder:
        folders = _load(folder)
        entry = folders.get(folder_id)
        if entry and not reset:
            counter = max(counter, entry["counter"])
        for other in folders.values():
            if other.get("path") == str(path):
                other["path"] = None
        folders[folder_id] = {"counter": counter, "path": str(path), "time": time.time()}
        if len(folders) > KEEP:
            newest = sorted(folders, key=lambda f: folders[f]["time"])[-KEEP:]
            folders = {f: folders[f] for f in newest}
        _save(folder, folders)


@contextlib.contextmanager
def _locked() -> Iterator[int]:
    """The key's folder, checked, while this process holds the lock on the key file."""
    folder = key_folder()
    try:
        key = os.open(key_path().name, READ_FILE | os.O_NONBLOCK, dir_fd=folder)
        try:
            fcntl.flock(key, fcntl.LOCK_EX)
            yield folder
        finally:
            os.close(key)
    finally:
        os.close(folder)


def _load(folder: int) -> dict[str, dict[str, Any]]:
    path = key_path().with_suffix(".folders")
    try:
        fd = os.open(ledger_name(), READ_FILE | os.O_NONBLOCK, dir_fd=folder)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise NotPrivate(f"the record of your checkpoint folders {path} cannot be read "
                         f"({exc.strerror}): remove it if it is a link.") from None
    with open(fd, "rb") as file:
        problem = private_file_problem(fd, path)
        if problem:
            raise NotPrivate(f"the record of your checkpoint folders is not used: {problem}. "
                             f"Run `chmod 600 {path}` if it is yours, or remove it.")
        try:
            data = json.loads(file.read(_MAX_SIZE))
            folders = data["folders"]
            assert all(isinstance(e["counter"], int) for e in folders.values())
        except (ValueError, KeyError, TypeError, AssertionError) as exc:
            raise NotPrivate(f"the record of your checkpoint folders {path} is damaged "
                             f"({exc!r}): remove it (the checks it allows start again with "
                             "each folder's next checkpoint).") from None
    return folders


def _save(folder: int, folders: dict[str, dict[str, Any]]) -> None:
    name = ledger_name()
    # A name of its own each time: in a shared sticky folder another user could make a
    # fixed one first, and no write could then replace it.
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = new_file(folder, tmp)
    try:
        with open(fd, "wb", closefd=False) as file:
            file.write(json.dumps({"version": 1, "folders": folders}).encode())
        os.fsync(fd)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    finally:
        os.close(fd)
