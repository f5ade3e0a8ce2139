"""Signed, length-prefixed messages: between the agent and its workers (pipes), and
between machines (hub links).

Every frame is ``len (8 bytes) | HMAC-SHA256 (32 bytes) | pickled body``. The MAC is
checked before anything is unpickled, so a peer without the job's secret cannot make the
other side run code. A length above the receiver's limit is refused before anything is
allocated for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import os
import pickle
import secrets
import struct
from typing import Any

KEY_BYTES = 32
_HEADER = struct.Struct("!Q")
_MAC_BYTES = hashlib.sha256().digest_size


class ProtocolError(RuntimeError):
    """A frame failed verification, was too large, or the stream ended mid-frame."""


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 36  # unknown: 64 GiB


# The largest frame a receiver accepts. Pipes and links both carry State snapshots and
# cell payloads, which can be as large as a model with its optimizer state, so no small
# fixed cap fits every job; but a frame must fit in this machine's memory to be read at
# all. A longer length (a corrupt stream, or a peer sending 2**40) is refused with a clear
# error instead of ending in MemoryError or an out-of-memory kill.
MAX_FRAME = _memory_bytes()


def new_secret() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def sign(key: bytes, body: bytes | bytearray) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def encode(key: bytes, message: Any) -> list[bytes]:
    """A frame as its parts (header, MAC, body): written without joining them, which
    would copy a large body once more."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return [_HEADER.pack(len(body)), sign(key, body), body]


def decode_body(key: bytes, mac: bytes | bytearray, body: bytes | bytearray) -> Any:
    if not hmac.compare_digest(mac, sign(key, body)):
        raise ProtocolError("message signature does not match the job's secret; refused")
    return pickle.loads(body)


def _read_exact(fd: int, size: int) -> bytearray | None:
    """``size`` bytes from ``fd`` into one buffer; None on a clean EOF before any byte."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        count = os.readv(fd, [view[done:]])
        if not count:
            if done == 0:
                return None
            raise ProtocolError("stream ended in the middle of a message")
        done += count
    return buffer


def widen_pipe(fd: int) -> None:
    """Ask Linux for a 1 MiB pipe buffer: large snapshots cross with fewer switches."""
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # above pipe-max-size: keep the default
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)


class Channel:
    """One direction of a signed message stream over a file descriptor."""

    def __init__(self, fd: int, key: bytes, max_frame: int = MAX_FRAME) -> None:
        self.fd = fd
        self.key = key
        self.max_frame = max_frame

    def send(self, message: Any) -> None:
        parts = [memoryview(p) for p in encode(self.key, message)]
        while parts:
            written = os.writev(self.fd, parts)
            while parts and written >= len(parts[0]):
                written -= len(parts[0])
                parts.pop(0)
            if parts:
                parts[0] = parts[0][written:]

    def recv(self) -> Any:
        """The next message; raises EOFError when the other side has closed."""
        header = _read_exact(self.fd, _HEADER.size)
        if header is None:
            raise EOFError
        (length,) = _HEADER.unpack(header)
        if length > self.max_frame:
            raise ProtocolError(
                f"the other side announced a message of {length} bytes, more than the "
                f"{self.max_frame}-byte limit (this machine's memory); the connection is "
                "closed")
        mac = _read_exact(self.fd, _MAC_BYTES)
        body = _read_exact(self.fd, length) if length else bytearray()
        if mac is None or body is None:
            raise ProtocolError("stream ended in the middle of a message")
        return decode_body(self.key, mac, body)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
