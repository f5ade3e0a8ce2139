"""A sharded State's commit arrives in parts, one per rank, each sent while its rank trains
on: the parts are held here until every part of one commit (the same ``token``, rank 0's
random number for it) is in, then put together as one snapshot (``snapshot_format``'s
parts layout), in a memory file. A part of a commit that never completed (a rank died
before sending its own) is replaced by the next commit's, never joined to it."""

from __future__ import annotations

import os

from ...snapshot_format import parts_header


class CommitParts:
    def __init__(self) -> None:
        self._parts: dict[int, tuple[int, bytes | int]] = {}  # part -> (token, bytes or fd)

    def add(self, part: int, parts: int, token: int, data: bytes | None,
            fd: int | None) -> bool:
        """Hold a part (``fd`` is then ours); True once every part of its commit is in."""
        self._close(self._parts.pop(part, None))
        self._parts[part] = (token, fd if fd is not None else (data or b""))
        return all(self._parts.get(i, (None,))[0] == token for i in range(parts))

    def join(self, parts: int) -> tuple[bytes | None, int | None]:
        """The complete commit's parts as one snapshot: bytes, or a memory file (ours to
        own); the parts held are released."""
        sources = [self._parts[i][1] for i in range(parts)]
        try:
            sizes = [os.fstat(s).st_size if isinstance(s, int) else len(s) for s in sources]
            if not hasattr(os, "memfd_create"):
                return parts_header(sizes) + b"".join(
                    os.pread(s, n, 0) if isinstance(s, int) else s
                    for s, n in zip(sources, sizes, strict=True)), None
            out = os.memfd_create("elastic-snapshot", os.MFD_CLOEXEC)
            try:
                os.write(out, parts_header(sizes))
                for part, (source, size) in enumerate(zip(sources, sizes, strict=True)):
                    append(out, source, size)
                    # released once copied: the parts and their join are not all held at
                    # once (beside the commit before, kept until this one is whole)
                    self._close(self._parts.pop(part))
            except BaseException:
                os.close(out)
                raise
            return None, out
        finally:
            self.close()

    def close(self) -> None:
        for _, source in self._parts.values():
            self._close(source)
        self._parts.clear()

    @staticmethod
    def _close(held: tuple[int, bytes | int] | bytes | int | None) -> None:
        source = held[1] if isinstance(held, tuple) else held
        if isinstance(source, int):
            os.close(source)


def append(out: int, source: bytes | int, size: int) -> None:
    """Append ``source`` (bytes, or ``size`` bytes of a descriptor) to the file ``out``."""
    if isinstance(source, int):
        offset = 0
        while offset < size:  # kernel to kernel: no copy through Python
            sent = os.sendfile(out, source, offset, size - offset)
            if not sent:
                raise OSError(f"snapshot ended at {offset} of {size} bytes")
            offset += sent
        return
    view = memoryview(source)
    while view:
        view = view[os.write(out, view):]


def memory_copy(source: int, offset: int, size: int) -> int:
    """``size`` bytes of the file ``source`` from ``offset``, copied file to file in the
    kernel into a new memory file (the caller's)."""
    out = os.memfd_create("elastic-snapshot", os.MFD_CLOEXEC)
    try:
        copy_range(source, offset, out, 0, size)
    except BaseException:
        os.close(out)
        raise
    return out


def copy_range(source: int, offset: int, out: int, at: int, size: int) -> None:
    """Copy ``size`` bytes of ``source`` from ``offset`` to ``out`` at ``at``, in the kernel
    (sendfile: copy_file_range refuses files on different file systems)."""
    os.lseek(out, at, os.SEEK_SET)
    done = 0
    while done < size:
        sent = os.sendfile(out, source, offset + done, size - done)
        if not sent:
            raise OSError(f"the file ended at {offset + done} of {offset + size} bytes")
        done += sent
