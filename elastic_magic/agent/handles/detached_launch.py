"""Starting a detached job: its agent process (``detached_agent``), handed the job through
its stdin, and the kernel attached to it.

A kernel that has detached one job keeps the next one's agent ready (the *standby*): a
process started beforehand whose warm pool imports torch meanwhile, for the last detached
job's size, folder and path. A detached launch then costs what a launch in the kernel does,
not a cold start. The standby exits when the kernel does (its stdin closes) or when the
extension is unloaded, and its zygote with it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pickle
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ... import folders
from ...spec import JobSpec
from ...wire.payload import Payload
from ..node import interpreter
from . import detached_folder
from .attached import AttachedJob, DetachedError
from .detached_agent import Order, Prewarm
from .handle import new_run_id

_MODULE = "elastic_magic.agent.handles.detached_agent"
STALE_LOG = 60.0  # seconds: an agent's log this old, that no process holds, is left over
LOG_PREFIX = ".agent-locked-"  # logs whose agent holds their lock (the sweep looks at no other)


@dataclass
class _Agent:
    """A detached agent process this kernel started, not yet handed a job."""

    process: subprocess.Popen[bytes]
    log: str  # its log's name in the runtime folder, until the job renames it
    prewarmed: Prewarm | None = None

    @property
    def stdin(self) -> IO[bytes]:
        assert self.process.stdin is not None
        return self.process.stdin

    def give_up(self) -> None:
        """It exits (its stdin closed, no job read); reaped by its thread."""
        self.stdin.close()
        if self.process.stdout is not None:
            self.process.stdout.close()


_standby: _Agent | None = None
_lock = threading.Lock()


def sweep_logs(folder: Path) -> None:
    """Remove the logs of agents killed before they had a job (a standby killed by the OOM
    killer, say). An agent holds its log's lock from birth (its stderr shares the lock the
    kernel took); one killed released it. A job's agent renames its log to the job's."""
    for path in folder.glob(f"{LOG_PREFIX}*.log"):
        with contextlib.suppress(OSError):  # BlockingIOError: its agent lives
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if time.time() - os.fstat(fd).st_mtime > STALE_LOG:  # not one starting now
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    path.unlink()
            finally:
                os.close(fd)


def _spawn(prewarm: Prewarm | None) -> _Agent:
    folder = detached_folder.runtime_folder()
    sweep_logs(folder)
    name = f"{LOG_PREFIX}{secrets.token_hex(6)}.log"
    log = os.open(folder / name, folders.NEW_FILE, 0o600)
    try:
        # The agent's stderr: held while the agent lives. Where the filesystem has no
        # flock, the sweep cannot take it either, and removes nothing.
        with contextlib.suppress(OSError):
            fcntl.flock(log, fcntl.LOCK_EX)
        process = subprocess.Popen(
            interpreter.command(_MODULE, name), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log,
            cwd=prewarm.cwd if prewarm is not None else None,
            env=interpreter.without_relative_pythonpath(dict(os.environ)),
            start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    # Reaped here while this kernel lives; by init once it is gone.
    threading.Thread(target=process.wait, daemon=True, name="elastic-reap-agent").start()
    agent = _Agent(process, name, prewarm)
    if prewarm is not None:
        pickle.dump(prewarm, agent.stdin)
        agent.stdin.flush()
    return agent


def _ready_agent(wanted: Prewarm) -> _Agent:
    """The standby if it was made for this job and still waits; else a new agent."""
    global _standby
    with _lock:
        agent, _standby = _standby, None
    if agent is not None and agent.prewarmed == wanted and agent.process.poll() is None:
        return agent
    if agent is not None:
        agent.give_up()
    return _spawn(None)


def _environ() -> str:
    """The kernel's environment as a digest: a standby started before it changed (an
    ``os.environ`` set in a cell since) is not the next job's."""
    return hashlib.sha256(repr(sorted(os.environ.items())).encode()).hexdigest()


def start(spec: JobSpec, payload: Payload, *, title: str = "",
          run_id: str | None = None) -> AttachedJob:
    """Start ``payload`` as a detached job (its agent in a process of its own) and attach.
    Its result waits ``spec.keep`` seconds for a kernel once it has ended.

    Args:
        spec: The job's options (``--detach`` among them or not: it is detached).
        payload: What every rank runs.
        title: How ``%elastic attach`` lists it (the cell's magic line).
        run_id: Its name; default a new one.

    Returns:
        The attached handle.

    Raises:
        DetachedError: The agent did not start (its log says why).
    """
    global _standby
    run_id = run_id or new_run_id()
    warm = Prewarm(spec.nproc, payload.cwd, tuple(payload.sys_path), spec.preload,
                   _environ(), spec.pool)
    agent = _ready_agent(warm)
    try:
        with agent.stdin:
            pickle.dump(Order(spec, payload, run_id, title), agent.stdin)
    except BrokenPipeError:
        pass  # it died: its log says why, below
    assert agent.process.stdout is not None
    with agent.process.stdout:  # one line once it listens and its connection file is there
        ready = agent.process.stdout.readline()
    folder = detached_folder.runtime_folder()
    if not ready:
        log = folder / f"{run_id}.log"
        log = log if log.exists() else folder / agent.log
        try:
            said = log.read_text(errors="replace")
            log.unlink()  # said here: nothing is left
        except OSError as exc:
            said = f"(its log {log} could not be read: {exc})"
        raise DetachedError(f"the detached agent of {run_id} did not start:\n{said[-2000:]}")
    with _lock, contextlib.suppress(Exception):  # the next detached job finds it warm
        if _standby is None:  # (best effort: this job runs, and its handle comes back)
            _standby = _spawn(warm)
    connection = detached_folder.read(folder / f"{run_id}.json")
    if connection is None:
        raise DetachedError(f"{run_id}: the agent's connection file is not a private file")
    return AttachedJob(connection)


def drop_standby() -> None:
    """The standby agent exits (``%unload_ext``), its warm pool with it."""
    global _standby
    with _lock:
        agent, _standby = _standby, None
    if agent is not None:
        agent.give_up()
