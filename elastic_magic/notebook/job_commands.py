"""``%elastic jobs|status|stop|scale|logs|stacks``: this kernel's jobs, as the magics list
and drive them (a session's own commands are in ``notebook/session_magic.py``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from IPython.core.error import UsageError

from ..agent.handles.ended import EndedJob
from ..agent.handles.job import Job
from ..logs import rank_log
from ..spec import SpecError
from ..ui.ansi import for_terminal
from ..ui.describe import count_of, duration
from .comm import JobsChannel
from .magic_cells import parse_scale, print_pool, print_stacks, say
from .session import Session
from .session_magic import SessionCommands

# Finished jobs that `%elastic jobs` keeps listing; running jobs are always kept.
JOB_HISTORY = 100

USAGE = """\
%elastic jobs                     list this kernel's jobs
%elastic status [JOB]             state, world size, restarts, worker PIDs; the warm
                                  pool: what it preloads, what it left out and why
%elastic pool forget              forget the modules the pool learned from cells and left
                                  out; the next job's zygote preloads only the defaults
%elastic stop [JOB]               stop a job's workers (SIGINT, SIGTERM, SIGKILL)
%elastic scale N [JOB] [--now] [--include S,...]   resize to N workers (at the next commit,
                                  or --now); --include brings back worker slots left out
%elastic scale --nodes N [JOB]    a --launcher job: ask the scheduler for N machines in all,
                                  or give some back (each leaves at the next commit)
%elastic logs RANK [JOB] [-n N] [--stderr]   last N lines of a rank's log
%elastic stacks [JOB]             every rank's Python stacks (all threads), without stopping
%elastic attach [RUN_ID] [-o NAME] [--text]   follow a --detach job (yours, on this
                                  machine; started in any kernel): its story so far, then
                                  live; without RUN_ID, the only one (else they are listed)
JOB is a number from `%elastic jobs` or a run id; the default is the latest job (for
logs and stacks: the session, while one is active)."""


def _not_followed(job: Job | EndedJob) -> str:
    """Why a command cannot reach ``job`` from here: it ended, or this kernel let it go."""
    if getattr(job, "detached", False):
        return (f"{job.run_id} runs on, detached from this kernel: `%elastic attach "
                f"{job.run_id}` follows it again")
    return f"{job.run_id} has already ended ({job.state.value})"


def visible(line: str) -> str:
    """A log line as a terminal showed it: after its last carriage return; its colours
    kept and its cursor codes dropped, as ``--text`` prints it (``ui.ansi``)."""
    end = "\n" if line.endswith("\n") else ""
    parts = [p for p in line.rstrip("\n").rstrip("\r").split("\r") if p]
    return for_terminal(parts[-1] if parts else "") + end


class JobCommands:
    """This kernel's jobs: ``numbers`` is the kernel's count of jobs and sessions (the
    panel's), ``sessions`` its session (``%elastic logs`` reads a session's logs)."""

    def __init__(self, channel: JobsChannel, numbers: Iterator[int],
                 sessions: SessionCommands) -> None:
        self.jobs: dict[int, Job | EndedJob] = {}  # every running one, the latest ended
        self.channel = channel
        self.numbers = numbers
        self.sessions = sessions

    def remember(self, job: Job) -> int:
        """Number the job for %elastic; keep a bounded history of finished jobs, each as
        what %elastic and the panel show of it (not its values, variables or snapshot)."""
        number = next(self.numbers)
        self.jobs[number] = job
        finished = [n for n, j in self.jobs.items() if j.done]
        for old in finished[:max(0, len(self.jobs) - JOB_HISTORY)]:
            del self.jobs[old]
        for n, kept in self.jobs.items():
            if isinstance(kept, Job) and kept.done and not getattr(kept, "detached", False):
                self.jobs[n] = EndedJob.of(kept)
        self.channel.forget(self.jobs.values())
        return number

    def end_all(self, reason: str) -> None:
        for job in list(self.jobs.values()):
            job.end(reason)

    def job(self, words: list[str]) -> Job | EndedJob:
        if not self.jobs:
            raise UsageError("%elastic: no job has run in this kernel yet.")
        if not words:
            return self.jobs[max(self.jobs)]
        key = words[0].removeprefix("#")  # "#2", as the panel and %elastic jobs number it
        if key.isdigit() and int(key) in self.jobs:
            return self.jobs[int(key)]
        for job in self.jobs.values():
            if job.run_id == key:
                return job
        raise UsageError(f"%elastic: no job {key!r}; `%elastic jobs` lists them.")

    def print_jobs(self) -> None:
        if not self.jobs:
            print("no elastic jobs in this kernel yet")
            return
        for number, job in self.jobs.items():
            s = job.status()
            elapsed = duration(job.status_snapshot.elapsed)  # stops when the job ends
            print(f"{number:>3}  {job.run_id}  {s['state']:<10} world size {s['world_size']}  "
                  f"restarts {s['restarts']}  {elapsed}")

    def print_status(self, words: list[str]) -> None:
        job = self.job(words)
        for key, value in job.status().items():
            print(f"{key:>10}: {value}")
        if job.result is not None and job.result.failure is not None:
            print(f"root cause: rank {job.result.failure.rank}: {job.result.failure.headline}")
        print_pool()

    def stop(self, words: list[str]) -> None:
        job = self.job(words)
        if job.done:
            say(_not_followed(job))
            return
        job.stop("%elastic stop")
        if job.wait_done(timeout=30):
            say(f"{job.run_id} stopped; its workers have exited")
        else:
            say(f"{job.run_id} is still stopping")

    def scale(self, words: list[str]) -> None:
        if "--nodes" in words:
            return self.scale_nodes([w for w in words if w != "--nodes"])
        nproc, rest, immediate, include = parse_scale(words)
        job = self.job(rest)
        if job.done:
            raise UsageError(f"%elastic scale: {_not_followed(job)}.")
        try:
            job.scale(nproc, immediate=immediate, include=include)
        except SpecError as exc:
            raise UsageError(f"%elastic {exc}") from None
        say(f"{job.run_id}: resize to {count_of(nproc, 'worker')} requested")

    def scale_nodes(self, words: list[str]) -> None:
        if not words or not words[0].isdigit():
            raise UsageError("%elastic scale --nodes: how many machines? For example "
                             "`%elastic scale --nodes 3`.")
        job = self.job(words[1:])
        if job.done:
            raise UsageError(f"%elastic scale: {_not_followed(job)}.")
        try:
            job.scale_nodes(int(words[0]))
        except SpecError as exc:
            raise UsageError(f"%elastic {exc}") from None
        say(f"{job.run_id}: {count_of(int(words[0]), 'machine')} asked of its launcher")

    def print_stacks(self, words: list[str]) -> None:
        """What each rank is doing now; for a finished job, what its stuck ranks were doing
        when it failed by a timeout or a stall."""
        job = self.job(words)
        if job.done:
            print(f"{job.run_id} has ended ({job.state.value}); "
                  + ("the stacks it kept of its stuck ranks:" if job.stacks()
                     else "it kept no stacks (only a timeout or a stall keeps them)."))
        try:
            stacks = job.stacks()
        except TimeoutError as exc:
            raise UsageError(f"%elastic stacks: {exc}") from None
        if not stacks and not job.done:
            print(f"{job.run_id}: no rank is running ({job.state.value})")
        print_stacks(stacks)

    def print_logs(self, words: list[str]) -> None:
        lines, stream, rest = 40, "stdout", []
        it = iter(words)
        for word in it:
            if word == "--stderr":
                stream = "stderr"
            elif word == "-n":
                value = next(it, "")
                if not value.isdigit():
                    raise UsageError("%elastic logs: -n takes a number of lines.")
                lines = int(value)
            else:
                rest.append(word)
        if not rest or not rest[0].isdigit():
            raise UsageError(f"%elastic logs: which rank? For example `%elastic logs 0`.\n"
                             f"{USAGE}")
        rank = int(rest[0])
        session = self.sessions.session
        # The session's own logs, unless a job is named: its cells are not jobs.
        target: Job | EndedJob | Session = session if session is not None and not rest[1:] \
            else self.job(rest[1:])
        path = rank_log(target.log_dir, rank, stream)
        if path is None or not path.exists():
            raise UsageError(f"%elastic logs: no {stream} log for rank {rank} of "
                             f"{target.run_id}.")
        with open(path, errors="replace", newline="") as f:
            tail = deque(f, maxlen=lines)
        print(f"==> {path} <==")
        # A line rewritten with carriage returns (a progress bar) as it finally showed.
        print("".join(visible(line) for line in tail), end="")
