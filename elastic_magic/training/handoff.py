"""How a commit's snapshot reaches the agent, and how a restore reads the agent's copy.

A large snapshot is dominated by copies, so it is written once: into the agent's memory
file for the commit, opened through /proc (its pages are reused from commit to commit);
where the agent keeps none (a joined machine keeps its ranks' own), into one of ours that
it reads; where neither can be opened, it goes down the pipe. A worker keeps to the route
that worked.
"""

from __future__ import annotations

import fcntl
import functools
import io
import os
from typing import Any

from ..wire.messages import Commit, CommitReply, CommitTarget, Handoff
from ..worker.client import AgentClient
from . import snapshot_format
from .file_locks import ofd_lock


def send(client: AgentClient, prepared: snapshot_format.Prepared,
          commit: functools.partial[Commit]) -> None:
    """Commit a snapshot (or a rank's part of one) in the agent, by the first route that
    works (see the module's docstring)."""
    global _HANDOFF, _TARGET
    reply: CommitReply
    if _TARGET:
        token, sizes, part = (commit.keywords[k] for k in ("token", "sizes", "part"))
        reply = client.request(lambda request_id: CommitTarget(request_id, token, sizes))
        if reply.target is not None and _write_into(reply.target, prepared,
                                                    snapshot_format.layout(sizes), part):
            return _check(client.request(lambda request_id: commit(request_id,
                                                                   written=True)))
        _TARGET = False  # the agent keeps none here, or its files cannot be opened
    if _HANDOFF:
        fd = os.memfd_create("elastic-snapshot", os.MFD_CLOEXEC)
        try:
            with os.fdopen(fd, "wb", closefd=False) as file:
                prepared.write(file)
            offer = Handoff.of(fd)
            reply = client.request(lambda request_id: commit(request_id, handoff=offer))
        finally:
            os.close(fd)
        if not reply.handoff_failed:
            return _check(reply)
        _HANDOFF = False  # the agent cannot read our memory files: use the pipe
    buffer = io.BytesIO()
    prepared.write(buffer)
    blob = buffer.getvalue()
    _check(client.request(lambda request_id: commit(request_id, snapshot=blob)))


def _check(reply: CommitReply) -> None:
    if reply.error:
        raise RuntimeError(reply.error)


_HANDOFF = hasattr(os, "memfd_create")
_TARGET = _HANDOFF


def _write_into(target: Handoff, prepared: snapshot_format.Prepared,
                layout: tuple[bytes, list[int], int], part: int) -> bool:
    """Write our part into the agent's file for the commit; False where it cannot be
    opened (or is not the size the commit's parts add up to)."""
    try:
        fd = os.open(target.path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        # held while writing: the agent does not give the file to another commit meanwhile
        ofd_lock(fd, fcntl.F_RDLCK)
        if os.fstat(fd).st_size != layout[2]:
            return False
        prepared.write_at(fd, layout[1][part])
        return True
    finally:
        os.close(fd)


def open_handoff(offer: Handoff | None) -> Any:
    """The agent's memory file holding the snapshot, opened through /proc; None if there
    is none or it cannot be opened."""
    if offer is None:
        return None
    try:
        file = open(offer.path, "rb")  # noqa: SIM115 (the caller's)
    except OSError:
        return None
    ofd_lock(file.fileno(), fcntl.F_RDLCK)  # read while locked: the agent reuses it after
    return file
