"""The agent's commit files: ranks write their parts straight into them, and they are
reused from commit to commit, but never while someone still reads one (the store, the
checkpoint writer, a JobResult, a restoring rank)."""

from __future__ import annotations

import fcntl
import io
import os
import threading
import time

import pytest
import torch

import elastic_magic as em
from elastic_magic.agent.node.commit_files import CommitFiles
from elastic_magic.training import snapshot_format
from elastic_magic.training.file_locks import ofd_lock


def _inode(fd: int) -> int:
    return os.fstat(fd).st_ino


def _write_part(parts: CommitFiles, token: int, sizes: tuple[int, ...], part: int,
                data: bytes) -> None:
    """What a rank does: open the agent's file through /proc, lock it, write its part."""
    fd, offset = parts.locate(token, sizes, part)
    mine = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        ofd_lock(mine, fcntl.F_RDLCK)
        os.pwrite(mine, data, offset)
    finally:
        os.close(mine)


@pytest.mark.unit
def test_commit_files_are_reused_only_once_no_one_reads_them():
    parts = CommitFiles()
    sizes = (3, 5)
    try:
        held = None  # the store's descriptor of the latest whole commit
        reader = None  # a duplicate kept by someone else (a checkpoint writer, say)
        seen = set()
        for commit in range(1, 30):
            token = 1000 + commit
            _write_part(parts, token, sizes, 1, bytes([commit]) * 5)
            assert parts.add(1, token, sizes) is None  # rank 0's part is still to come
            whole = parts.add(0, token, sizes, bytes([commit]) * 3)  # copied in
            assert whole is not None
            seen.add(_inode(whole))
            spans = snapshot_format.part_spans(lambda n, fd=whole: os.pread(fd, n, 0))
            assert spans is not None
            assert [os.pread(whole, n, at) for at, n in spans] == [bytes([commit]) * 3,
                                                                   bytes([commit]) * 5]
            if commit == 10:
                reader = os.dup(held)  # its commit (9) must stay as it is while read
            if held is not None:
                os.close(held)  # the store moves on to the new commit
            held = whole
        assert reader is not None
        spans = snapshot_format.part_spans(lambda n: os.pread(reader, n, 0))
        assert spans is not None
        assert os.pread(reader, 3, spans[0][0]) == bytes([9]) * 3  # never reused meanwhile
        # one file held by the store, one by the reader, one being written: a handful in
        # all over 29 commits, not one each
        assert len(seen) <= 4, seen
        os.close(reader)
        assert held is not None
        os.close(held)
    finally:
        parts.close()


@pytest.mark.unit
def test_a_commit_that_never_completed_is_dropped_not_joined_to_the_next():
    parts = CommitFiles()
    try:
        parts.add(0, 1, (2, 2), b"aa")  # rank 1 died before its part of commit 1
        parts.add(1, 2, (2, 2), b"BB")
        whole = parts.add(0, 2, (2, 2), b"AA")
        assert whole is not None
        assert os.pread(whole, 4, os.fstat(whole).st_size - 4) == b"AABB"
        os.close(whole)
    finally:
        parts.close()


COMMITS = """
import os, time, torch, elastic_magic
made = []  # the memory files this rank creates (a commit used to write one each)
create = os.memfd_create
os.memfd_create = lambda *args, **kwargs: made.append(args) or create(*args, **kwargs)
weights = torch.zeros(256 * 1024)  # 1 MB
state = elastic_magic.State(weights=weights, step=0)
while state.step < 40:
    weights += 1
    state.step += 1
    state.commit()
    time.sleep(0.02)
float(weights[0]), len(made)
"""


def test_a_jobs_commits_go_into_a_few_reused_files_of_the_agents(log_dir):
    """The ranks write their commits into the agent's memory files (in this process): a
    few, reused, not a new file each commit (a page fault per page each time)."""
    seen: set[int] = set()
    running = threading.Event()
    running.set()

    def watch() -> None:
        while running.is_set():
            for name in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{name}").startswith(
                            "/memfd:elastic-snapshot"):
                        seen.add(os.stat(f"/proc/self/fd/{name}").st_ino)
                except OSError:
                    pass
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = em.launch(COMMITS, nproc=2, log_dir=log_dir, render=lambda events: None)
    finally:
        running.clear()
        watcher.join()
    assert result.ok, result
    assert result.values == {0: (40.0, 0), 1: (40.0, 0)}
    assert result.commit is not None and result.commit["step"] == 40
    assert result.snapshot is not None
    kept = snapshot_format.load(io.BytesIO(result.snapshot))
    assert torch.equal(kept["values"]["weights"], torch.full((256 * 1024,), 40.0))
    # A few (2 to 4 on a quiet machine; a reader under load holds one a while longer),
    # where a file per commit would be 40.
    assert 1 <= len(seen) <= 8, f"{len(seen)} memory files for 40 commits"
