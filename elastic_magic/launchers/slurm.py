"""``--launcher slurm``: each machine is one Slurm job of one node, submitted with ``sbatch``.

The batch script (given to ``sbatch`` on stdin) runs ``srun PYTHON -c RUNNER
elastic_magic.cli join ENDPOINT --token-file FILE`` (``interpreter.remote_command``: not
``-m``, which imports from the workdir first): the token is in a file only its owner can
read, in a folder the cluster's nodes share with the notebook (the home folder by default),
removed when the allocations end; it is in no command line, script or ``squeue`` field.
``squeue`` gives each job's state and, while it waits, Slurm's Reason; ``scancel`` ends it,
and Slurm's SIGTERM (a cancel, or a preemption with its grace time) makes the join leave
the job. What a job prints (its machine's ranks' lines) goes to a file of a 0700 folder the
nodes share (``output_dir``), not to Slurm's ``slurm-%j.out`` in the working directory, which
Slurm creates with the user's umask, where others may read it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shlex
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from .. import folders
from ..agent.node import interpreter
from ..checks import SpecError
from . import Allocation, JoinRequest, LauncherError, known_options
from .watchdog import submitting

OPTIONS = {
    "partition": "sbatch --partition",
    "account": "sbatch --account",
    "time": "sbatch --time (the allocation's limit, e.g. 1:00:00)",
    "qos": "sbatch --qos",
    "sbatch_options": "further sbatch arguments, shell-quoted (e.g. --gres=gpu:4 "
                      "--exclusive)",
    "python": "the interpreter on the nodes that has elastic_magic (default: this one)",
    "nproc": "each machine's workers: N, auto, cpu or gpu (default: its own)",
    "token_dir": "a folder the nodes share, for the token file (default "
                 "~/.cache/elastic_magic/tokens)",
    "workdir": "the jobs' working directory (default: the notebook's)",
    "output_dir": "a folder the nodes share, for what each job prints (default "
                  "~/.cache/elastic_magic/slurm; made 0700, and must be yours and private)",
}
_STATES = {"PENDING": "pending", "CONFIGURING": "pending", "RUNNING": "running",
           "COMPLETING": "ended", "COMPLETED": "ended", "CANCELLED": "ended",
           "FAILED": "ended", "TIMEOUT": "ended", "PREEMPTED": "ended",
           "NODE_FAIL": "ended", "OUT_OF_MEMORY": "ended", "BOOT_FAIL": "ended",
           "DEADLINE": "ended", "REVOKED": "ended", "SPECIAL_EXIT": "ended"}


def _run(argv: list[str], stdin: str | None = None, hold: tuple[int, ...] = ()) -> str:
    """``argv``'s output. In a session of its own: the kernel's interrupt (SIGINT to its
    process group) cannot kill an ``sbatch`` after it submitted, before it said the id."""
    # sbatch hands its environment to the job: nothing of PYTHONPATH that names the job's
    # folder (an empty or relative entry) goes, where Python would import sitecustomize.
    env = interpreter.without_relative_pythonpath(
        {k: v for k, v in os.environ.items() if k != "ELASTIC_MAGIC_TOKEN"})
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                              timeout=60, start_new_session=True, pass_fds=hold)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LauncherError(f"{argv[0]}: {exc}") from None
    if done.returncode:
        raise LauncherError(f"{shlex.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _private_folder(path: Path, holds: str, option: str) -> None:
    """``path``, made 0700 where missing, reached from / as a checkpoint folder is (no
    folder on the way that others could change, no link another user made: Slurm opens its
    files by name later, and someone who could rename a folder on the way could put an
    open one there), and private: it holds ``holds``."""
    try:
        os.close(folders.own_path(folders.absolute(path), create=True, private=True)[0])
    except (folders.NotPrivate, OSError) as exc:
        raise LauncherError(f"{path} cannot hold {holds}: {exc}. Name a folder of yours "
                            f"with --launch {option}=DIR.") from None


class SlurmLauncher:
    """The launcher that asks Slurm for machines: each allocation is a one-node batch job
    that joins, watched with ``squeue`` and ended with ``scancel``."""

    name = "slurm"

    def __init__(self, options: Mapping[str, str]) -> None:
        known_options(self.name, options, OPTIONS)
        self.options = dict(options)
        try:
            extra = shlex.split(options.get("sbatch_options", ""))
        except ValueError as exc:
            raise SpecError(f"--launch sbatch_options: {exc}") from None
        self.output_dir = Path(os.path.expanduser(options.get("output_dir") or
                                                  "~/.cache/elastic_magic/slurm"))
        if not self.output_dir.is_absolute() or any(c in str(self.output_dir) for c in "%\\"):
            raise SpecError(f"--launch output_dir={options.get('output_dir')}: name a folder "
                            "the nodes share by its absolute path, without % or \\ (Slurm "
                            "would read them as a file name pattern).")
        # Both streams, in order, in one file per job (%x: its name, %j: its id); the
        # user's own sbatch_options may still name another.
        output = f"{self.output_dir}/%x-%j.out"
        self.sbatch = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1",
                       f"--output={output}", f"--error={output}", *extra, *(
            f"--{flag}={options[key]}" for key, flag in
            (("partition", "partition"), ("account", "account"), ("time", "time"),
             ("qos", "qos")) if options.get(key))]
        self.python = options.get("python", sys.executable)
        self.token_dir = Path(options.get("token_dir") or folders.token_folder())
        self.workdir = options.get("workdir") or os.getcwd()
        self._jobs: list[str] = []
        self._token_file: Path | None = None
        self._lock = threading.Lock()
        self._token_path: Path | None = None  # chosen before the file is written
        self._count = itertools.count(1)
        self._next_name: str | None = None  # the next start's job name (prepare_start)
        self._names: dict[str, str] = {}  # job id -> its job name
        self._maybe: list[str] = []  # names of submissions whose sbatch failed

    def _write_token(self, request: JoinRequest) -> Path:
        """The token in a 0600 file of a 0700 folder, made without following links; the
        folder of the jobs' output made or checked (before each start: it may be gone)."""
        _private_folder(self.output_dir, "what the jobs print", "output_dir")
        if self._token_file is None:
            _private_folder(self.token_dir, "the job's token", "token_dir")
            path = self._token_path_for(request)
            try:  # O_EXCL: whatever is there already (a link) is refused, not followed
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise LauncherError(f"cannot write the job's token file: {exc}") from None
            with os.fdopen(fd, "w") as file:
                file.write(request.token)
            self._token_file = path
        return self._token_file

    def _token_path_for(self, request: JoinRequest) -> Path:
        """Where the token file goes, chosen before it is written: a watchdog knows it
        first (``orphan_files``)."""
        if self._token_path is None:
            self._token_path = self.token_dir / f"{request.run_id}-{secrets.token_hex(8)}"
        return self._token_path

    @staticmethod
    def _cancel_by_name(name: str) -> list[str]:
        """Cancels this user's job of that name, if there is one: exits 0 once Slurm has
        answered (whether the job was ever submitted or not)."""
        return ["scancel", f"--user={os.getuid()}", f"--name={name}"]

    def prepare_start(self, request: JoinRequest) -> tuple[str, list[list[str]]]:
        """The next ``start``'s job name and what cancels that job, and its token file's
        path (``orphan_files``), known before ``sbatch`` runs: a watchdog holds them, so a
        kernel killed during the submission leaves neither."""
        with self._lock:
            self._token_path_for(request)
            if self._next_name is None:
                self._next_name = self._new_name(request)
            return self._next_name, [self._cancel_by_name(self._next_name)]

    def _new_name(self, request: JoinRequest) -> str:
        """A job name no other job has: what a watchdog cancels it by."""
        return f"elastic-{request.run_id}-{next(self._count)}-{secrets.token_hex(3)}"

    def script(self, request: JoinRequest, token_file: Path) -> str:
        nproc = self.options.get("nproc") or request.nproc
        # not ``-m``: that would import from the workdir first
        join = interpreter.remote_command(
            self.python, "elastic_magic.cli", "join", request.endpoint, "--token-file",
            str(token_file), *(("--nproc", nproc) if nproc else ()))
        return ("#!/bin/sh\n"
                f"cd {shlex.quote(self.workdir)} || exit 1\n"
                f"exec srun --ntasks=1 --kill-on-bad-exit=1 {shlex.join(join)}\n")

    def start(self, request: JoinRequest) -> Allocation:
        with self._lock:
            token_file = self._write_token(request)
            name = self._next_name or self._new_name(request)
            self._next_name = None
            try:  # sbatch holds the watchdogs' pipe: a dead kernel's waits for its end
                out = _run([*self.sbatch, f"--job-name={name}", f"--chdir={self.workdir}"],
                           stdin=self.script(request, token_file), hold=submitting())
            except LauncherError:
                # It may have submitted before it failed (killed, timed out): cancelled by
                # its name now, or else by cancel_all.
                self._maybe.append(name)
                with contextlib.suppress(LauncherError):
                    _run(self._cancel_by_name(name))
                    self._maybe.remove(name)
                raise
            job_id = out.strip().split(";")[0]
            self._jobs.append(job_id)
            self._names[job_id] = name
        return Allocation(job_id, "pending")

    def allocations(self) -> list[Allocation]:
        with self._lock:
            jobs = list(self._jobs)
        if not jobs:
            return []
        out = _run(["squeue", "--noheader", f"--jobs={','.join(jobs)}",
                    "--format=%i|%T|%r|%N", "--states=all"])
        seen = {}
        for line in out.splitlines():
            job_id, state, reason, nodes = [*line.split("|"), "", "", ""][:4]
            described = _STATES.get(state.strip(), state.strip().lower())
            seen[job_id.strip()] = Allocation(
                job_id.strip(), described,
                reason.strip() if reason.strip() not in ("None", "") else
                ("" if described != "ended" else state.strip()), nodes.strip())
        return [seen.get(j, Allocation(j, "ended")) for j in jobs]

    def cancel(self, allocation_id: str) -> None:
        """The job stays this launcher's until Slurm confirms its end (a LauncherError says
        it did not yet; cancel_all tries it again)."""
        with self._lock:
            if allocation_id not in self._jobs:
                return
        self._end([allocation_id])

    def _end(self, jobs: list[str]) -> None:
        """``scancel``; the jobs Slurm confirmed ended (scancel succeeded, or squeue lists
        them ended or no more) are forgotten, the others raise."""
        try:
            _run(["scancel", *jobs])
            failure, left = "", []
        except LauncherError as exc:  # "Socket timed out", say: it may have ended them
            failure, left = str(exc), self._queued(jobs)
        with self._lock:
            self._jobs = [j for j in self._jobs if j not in jobs or j in left]
        if left:
            raise LauncherError(f"{failure} (still queued: {', '.join(left)})")

    def _queued(self, jobs: list[str]) -> list[str]:
        """Those of ``jobs`` Slurm may still run: all where squeue cannot say."""
        try:
            out = _run(["squeue", "--noheader", f"--jobs={','.join(jobs)}", "--states=all",
                        "--format=%i|%T"])
        except LauncherError as exc:
            return [] if "Invalid job id" in str(exc) else list(jobs)
        states = dict(line.partition("|")[::2] for line in out.split())
        return [j for j in jobs if j in states and
                _STATES.get(states[j], states[j].lower()) != "ended"]

    def cancel_all(self) -> None:
        """Every job ended (by name those a failed sbatch may have submitted), the token
        file removed; the jobs Slurm did not confirm ended stay this launcher's (raises)."""
        with self._lock:
            jobs, names = list(self._jobs), list(self._maybe)
            token_file = self._token_file or self._token_path
            self._token_file = self._token_path = None
        failures = []
        try:
            for name in names:
                try:
                    _run(self._cancel_by_name(name))
                except LauncherError as exc:
                    failures.append(str(exc))
                    continue
                with self._lock:
                    self._maybe.remove(name)
            if jobs:
                try:
                    self._end(jobs)
                except LauncherError as exc:
                    failures.append(str(exc))
        finally:
            if token_file is not None:
                token_file.unlink(missing_ok=True)
        if failures:
            raise LauncherError("; ".join(failures))

    def orphan_cleanup(self, allocation_id: str) -> list[list[str]]:
        name = self._names.get(allocation_id)
        return [self._cancel_by_name(name) if name else ["scancel", allocation_id]]

    def orphan_files(self) -> list[str]:
        return [str(self._token_path)] if self._token_path else []
