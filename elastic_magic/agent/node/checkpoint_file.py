"""The checkpoint file, ``checkpoint.em``, signed:

    MAGIC | u64 metadata length | metadata (JSON) | snapshot | HMAC-SHA256 of all before

The metadata holds the folder's seal (``checkpoint_folder``): which folder, where, and the
how-manyth checkpoint of it this is, so an older one put in its place is told apart.

The tag is computed with the user's key (``elastic_magic.training.checkpoint_key``) as the file is
written and checked as it is read into a memory file, before anything in it (the metadata
included) is parsed or unpickled: a checkpoint written with another key, or changed by a
byte, or cut short, is refused whole. Both sides stream the snapshot (states are GBs).
An ``EMCKPT01`` file of an earlier version carries no signature: it is refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from ...folders import NotPrivate
from .commit_files import append

MAGIC = b"EMCKPT02"
UNSIGNED = b"EMCKPT01"  # earlier versions' checkpoints: no signature
_LENGTH = struct.Struct("<Q")
_START = len(MAGIC) + _LENGTH.size
_TAG = hashlib.sha256().digest_size
_MAX_META = 1 << 20  # the metadata is a few numbers: a larger length is not ours
_CHUNK = 8 << 20


class CheckpointRefused(NotPrivate):
    """A checkpoint that is not loaded: the message says why and what to do."""


def header(meta: dict[str, Any]) -> bytes:
    """What precedes the snapshot in ``checkpoint.em``."""
    text = json.dumps(meta).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text


def write(out: int, key: bytes, meta: dict[str, Any], source: bytes | int | None,
          size: int) -> None:
    """Append the checkpoint of ``source`` (bytes, or ``size`` bytes of a descriptor) to
    the file ``out``, its tag last."""
    head = header(meta)
    mac = hmac.new(key, head, hashlib.sha256)
    append(out, head, len(head))
    append(out, source or b"", size)
    if isinstance(source, int):  # read back in chunks: the snapshot is never whole here
        buffer = bytearray(_CHUNK)
        done = 0
        while done < size:
            got = os.preadv(source, [memoryview(buffer)[:min(_CHUNK, size - done)]], done)
            if not got:
                raise OSError(f"snapshot ended at {done} of {size} bytes")
            mac.update(memoryview(buffer)[:got])
            done += got
    else:
        mac.update(source or b"")
    append(out, mac.digest(), _TAG)


def load(file: BinaryIO, path: Path, key: bytes) -> tuple[dict[str, Any], int]:
    """The metadata of the checkpoint ``file``, and its snapshot copied into a new memory
    file (the caller's), once its tag proves ``key`` signed it. Raises CheckpointRefused."""
    total = os.fstat(file.fileno()).st_size
    head = file.read(_START)
    if head[:len(MAGIC)] == UNSIGNED:
        raise CheckpointRefused(
            f"the checkpoint {path} was written by an earlier version of elastic_magic, "
            "without a signature: it is not loaded (loading it runs whatever it holds). "
            "Move it away to start from scratch; see the Security page of the docs, "
            "docs/explanation/security.md.")
    if head[:len(MAGIC)] != MAGIC or len(head) < _START:
        raise CheckpointRefused(f"{path} is not a checkpoint written by elastic_magic: it is "
                                "not loaded. Move it away, or give another --checkpoint-dir.")
    length = _LENGTH.unpack_from(head, len(MAGIC))[0]
    size = total - _START - length - _TAG
    if length > _MAX_META or size < 0:
        raise _refused(path, "it is cut short or damaged")
    mac = hmac.new(key, head, hashlib.sha256)
    meta = _exactly(file, length, path)
    mac.update(meta)
    out = os.memfd_create("elastic-snapshot", os.MFD_CLOEXEC)
    try:
        buffer = bytearray(_CHUNK)
        done = 0
        while done < size:
            got = file.readinto(memoryview(buffer)[:min(_CHUNK, size - done)])  # type: ignore[attr-defined]
            if not got:
                raise _refused(path, "it is cut short")
            view = memoryview(buffer)[:got]
            mac.update(view)
            while view:
                view = view[os.write(out, view):]
            done += got
        if not hmac.compare_digest(_exactly(file, _TAG, path), mac.digest()):
            raise _refused(path, "its signature does not match your key: it was written "
                                 "with another key, or changed or cut short after it was written")
        return json.loads(meta), out
    except BaseException:
        os.close(out)
        raise


def peek(file: BinaryIO) -> dict[str, Any]:
    """The metadata of the checkpoint ``file`` as its header says, unchecked ({} if it has
    none): never for what a job loads, only for a hint from a folder only the user writes."""
    head = file.read(_START)
    if head[:len(MAGIC)] != MAGIC or len(head) < _START:
        return {}
    length = _LENGTH.unpack_from(head, len(MAGIC))[0]
    try:
        meta = json.loads(file.read(min(length, _MAX_META)))
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The metadata and the snapshot of a whole ``checkpoint.em`` file's bytes (for tests;
    no check of the tag)."""
    if data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a signed checkpoint")
    end = _START + _LENGTH.unpack_from(data, len(MAGIC))[0]
    return json.loads(data[_START:end]), data[end:-_TAG]


def _exactly(file: BinaryIO, size: int, path: Path) -> bytes:
    data = file.read(size)
    if len(data) != size:
        raise _refused(path, "it is cut short")
    return data


def _refused(path: Path, why: str) -> CheckpointRefused:
    return CheckpointRefused(
        f"the checkpoint {path} is not loaded: {why}. Nothing in it was used. If another "
        "machine wrote it, copy its key file here (see the Security page of the docs, "
        "docs/explanation/security.md); otherwise move the checkpoint away to start from "
        "scratch.")
