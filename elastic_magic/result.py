"""What a job returns: per-rank values, the root-cause failure, where the logs are."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from .logs import rank_log
from .result_parts import MemorySnapshot, MetricSeries


class JobState(str, Enum):
    """What the job as a whole is doing (the dashboard's header)."""

    RENDEZVOUS = "rendezvous"
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    RESIZING = "resizing"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    IDLE = "idle"  # a session's workers wait for the next cell

    @property
    def is_final(self) -> bool:
        """Whether the job has ended: succeeded, failed or stopped."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass(frozen=True)
class RankFailure:
    """Why one rank failed: an exception in user code, or an exit code / signal.

    Attributes:
        rank: Its global rank.
        local_rank: Its rank on its machine.
        attempt: The group it ran in (its logs' ``group_<attempt>``).
        pid: Its process ID.
        time: When it failed (epoch seconds).
        exc_type: The exception's type name; None if it raised none.
        message: The exception's message.
        traceback: Formatted: user frames only, with the cell's line numbers.
        cell_line: The cell's line it failed at, if known.
        source_line: That line's code.
        exit_code: The process's exit code (negative: a signal), if it exited.
        signal: The signal that killed it ("SIGKILL"), if one did.
        log_dir: Its log folder.
        reason: Why a rank that raised nothing failed (stalled, returned while others waited).
        consequence: It only waited for another rank's failure (not a cause).
    """

    rank: int
    local_rank: int
    attempt: int
    pid: int
    time: float
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    cell_line: int | None = None
    source_line: str | None = None
    exit_code: int | None = None
    signal: str | None = None
    log_dir: str | None = None
    reason: str | None = None
    consequence: bool = False

    @property
    def headline(self) -> str:
        """One line: the reason, the exception, the signal or the exit code."""
        if self.reason:
            where = f" (cell line {self.cell_line})" if self.cell_line else ""
            return f"{self.reason}{where}"
        if self.exc_type:
            where = f" (cell line {self.cell_line})" if self.cell_line else ""
            return f"{self.exc_type}: {self.message}{where}".rstrip()
        if self.signal:
            return f"killed by {self.signal}"
        return f"exited with code {self.exit_code}"

    @property
    def signature(self) -> tuple[Any, ...]:
        """Failures with equal signatures are the same error on different ranks."""
        return (self.exc_type, self.message, self.traceback, self.exit_code, self.signal,
                self.reason)


@dataclass
class JobResult:
    """The outcome of one elastic job (or of a session's cell).

    Attributes:
        run_id: The job's name.
        state: How it ended: SUCCEEDED, FAILED or STOPPED.
        world_size: Ranks in its last group.
        restarts: Restarts used after failures; ``max_restarts`` the most allowed.
        max_restarts: The job's --max-restarts.
        duration: Seconds from ``started`` to its end.
        log_dir: Its ranks' logs: ``group_<n>/rank_<r>/{stdout,stderr}.log``.
        values: Each rank's value (the cell's last expression), by rank; on success only.
        failure: The root cause of the final failure (None unless it failed).
        failures: Every rank's failure of that attempt, root cause first.
        pulled: The --pull variables, copied from rank 0 (on success).
        missing_pulls: The --pull names rank 0 did not have.
        tails: Each rank's last output lines, by rank.
        stop_reason: Why it was stopped (STOPPED only).
        resizes: Resizes it went through.
        commit: The last committed State's step, time and world size (None: none).
        snapshot_source: The last commit: bytes, or in the agent's memory file (``snapshot``).
        stacks: Failed by a timeout or a stall: each stuck rank's stacks, before the teardown.
        excluded: Machines and worker slots it lost or gave up on, and why, in order.
        started: When it began, in epoch seconds (a session's cell: when the session took it).
        metrics: What the cell logged with ``elastic_magic.log``, by name (``metrics_frame``).
    """

    run_id: str
    state: JobState
    world_size: int
    restarts: int
    max_restarts: int
    duration: float
    log_dir: Path
    values: dict[int, Any] = field(default_factory=dict)
    failure: RankFailure | None = None
    failures: list[RankFailure] = field(default_factory=list)
    pulled: dict[str, Any] = field(default_factory=dict)
    missing_pulls: list[str] = field(default_factory=list)
    tails: dict[int, list[str]] = field(default_factory=dict)
    stop_reason: str | None = None
    resizes: int = 0
    commit: dict[str, Any] | None = None
    snapshot_source: bytes | MemorySnapshot | None = field(default=None, repr=False)
    stacks: dict[int, str] = field(default_factory=dict, repr=False)
    excluded: list[str] = field(default_factory=list)
    started: float = 0.0
    metrics: dict[str, MetricSeries] = field(default_factory=dict, repr=False)

    def metrics_frame(self) -> Any:
        """``metrics`` as a pandas DataFrame.

        Returns:
            A row per point; columns name, rank, step, value and time.

        Raises:
            ImportError: pandas is not installed (``metrics`` holds plain lists).
        """
        from .wire.metrics import as_frame

        return as_frame(self.metrics)

    @property
    def ok(self) -> bool:
        """Whether it succeeded."""
        return self.state is JobState.SUCCEEDED

    @property
    def value(self) -> Any:
        """Rank 0's value (the cell's last expression)."""
        return self.values.get(0)

    @property
    def snapshot(self) -> bytes | None:
        """The last commit's snapshot (``State(...).load(result.snapshot)``), read now."""
        source = self.snapshot_source
        return source.read() if isinstance(source, MemorySnapshot) else source

    def log_path(self, rank: int, stream: str = "stdout",
                 attempt: int | None = None) -> Path | None:
        """Full log of one rank.

        Args:
            rank: Its global rank.
            stream: "stdout" or "stderr".
            attempt: Its group's number (``group_<n>``); None: the last.

        Returns:
            The log file's path; None if the job has no group's logs.
        """
        return rank_log(self.log_dir, rank, stream, attempt)

    def summary(self) -> str:
        """One line: state, world size, restarts, duration, what it went on without.

        Returns:
            "failed, world size 2, restarts 1/1, 3.2s", say.
        """
        parts = [self.state.value, f"world size {self.world_size}",
                 f"restarts {self.restarts}/{self.max_restarts}", f"{self.duration:.1f}s"]
        if self.excluded:
            parts.append(f"went on without {'; '.join(self.excluded)}")
        return ", ".join(parts)

    def __repr__(self) -> str:
        """Short, whatever the ranks returned (tensors would print in full): the summary and
        rank 0's value cut to one line; ``.values`` has them all. A job that did not
        succeed says why: its root cause's headline, or why it was stopped."""
        if not self.values:
            why = " ".join((f"rank {self.failure.rank}: {self.failure.headline}"
                            if self.failure else self.stop_reason or "").split())
            why = f", why={why[:117] + '...' if len(why) > 120 else why}" if why else ""
            return f"JobResult({self.summary()}{why})"
        value = " ".join(repr(self.values[min(self.values)]).split())
        if len(value) > 60:
            value = value[:57] + "..."
        return (f"JobResult({self.summary()}, value={value}, "
                f"values of {len(self.values)} ranks in .values)")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


# How a rank reports that a peer vanished (gloo, NCCL, the store), or that it waited for
# peers too long: a consequence of another rank's failure, not a cause, unless nothing
# else failed around it.
_PEER_LOSS_MARKERS = ("closed by peer", "reset by peer", "Broken pipe", "remote process exited",
                      "Connection refused", "peer disconnected",
                      "Connection was likely closed")  # the store's (its host gone, or left)
_TIMEOUT_MARKERS = ("timed out", "timeout")  # gloo "Timed out waiting", NCCL's watchdog
# ...in torch.distributed, not a timeout of the user's own (a data server, a socket)
_DISTRIBUTED_MARKERS = ("torch/distributed/", "gloo", "NCCL", "c10d")
# The agent dates a death by signal when it sees the report pipe close, which can lag
# behind a surviving peer's exception by this much on a loaded machine.
_PEER_LOSS_WINDOW = 5.0


def is_consequence(failure: RankFailure) -> bool:
    """A rank that failed waiting for others: a lost peer or a timeout in its own report,
    or the agent found it waiting in a collective for the root cause."""
    if failure.consequence:
        return True
    if failure.exc_type is None:
        return False
    if any(m in failure.message for m in _PEER_LOSS_MARKERS):
        return True
    lowered = failure.message.lower()
    return any(m in lowered for m in _TIMEOUT_MARKERS) and any(
        m in failure.message or m in failure.traceback for m in _DISTRIBUTED_MARKERS)


def root_cause_order(failures: list[RankFailure]) -> list[RankFailure]:
    """Failures earliest first, except that a rank's "a peer vanished" or "timed out" error
    goes after a failure that came up to a few seconds later (the peer's death was the
    cause), and ranks the agent marked as consequences go last."""
    by_time = sorted(failures, key=lambda f: f.time)
    causes = [f for f in by_time if not is_consequence(f)]

    def key(failure: RankFailure) -> tuple[bool, float]:
        if is_consequence(failure) and not failure.consequence:
            later = [c.time for c in causes if 0 <= c.time - failure.time <= _PEER_LOSS_WINDOW]
            if later:
                return False, max(later) + 1e-6  # just after the death that caused it
        return failure.consequence, failure.time

    return sorted(by_time, key=key)


def short_message(failure: RankFailure) -> str:
    """One line for a consequence: its first line, without gloo's "[file.cc:N] " prefix."""
    if failure.reason:
        return failure.reason + (f" at cell line {failure.cell_line}" if failure.cell_line
                                 else "")
    if not failure.exc_type:
        return failure.headline
    text = (failure.message.strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text or failure.headline


def what_happened(failure: RankFailure) -> str:
    """What a rank did, in a clause: "rank 1 was killed by SIGKILL"."""
    if failure.reason:  # its first clause: "stalled", "returned early"
        what = failure.reason.split(":")[0]
    elif failure.signal:
        what = f"was killed by {failure.signal}"
    elif failure.exc_type:
        what = f"raised {failure.exc_type}"
    else:
        what = f"exited with code {failure.exit_code}"
    return f"rank {failure.rank} {what}"


def after(root: RankFailure) -> str:
    """What happened to the root cause, as in "(after rank 1 was killed by SIGKILL)"."""
    return f"after {what_happened(root)}"


def split_consequences(root: RankFailure, failures: list[RankFailure]
                       ) -> tuple[list[RankFailure], list[RankFailure]]:
    """Other ranks' failures: (independent ones, consequences of the root cause)."""
    others = [f for f in root_cause_order(failures) if f.rank != root.rank]
    if is_consequence(root):  # nothing explains it: every failure stands on its own
        return others, []
    return ([f for f in others if not is_consequence(f)],
            [f for f in others if is_consequence(f)])


def group_failures(failures: list[RankFailure]) -> list[tuple[RankFailure, list[int]]]:
    """Identical failures grouped: (first failure, ranks sharing it), root cause first."""
    groups: dict[tuple[Any, ...], list[RankFailure]] = defaultdict(list)
    for failure in root_cause_order(failures):
        groups[failure.signature].append(failure)
    return [(members[0], sorted(f.rank for f in members)) for members in groups.values()]


def describe_failure(result: JobResult) -> str:
    """Root cause first, then other ranks' failures grouped, then the consequences (ranks
    that only waited for the root cause) one line each; for people, not machines."""
    root = result.failure
    if root is None:
        return f"job {result.run_id} {result.state.value}"
    attempts = result.restarts + 1
    lines = [
        f"Rank {root.rank} failed first (attempt {attempts} of {result.max_restarts + 1}, "
        f"restarts used {result.restarts}/{result.max_restarts}): {root.headline}",
    ]
    if root.source_line:
        lines.append(f"    cell line {root.cell_line}: {root.source_line}")
    if root.traceback:
        lines += ["", root.traceback.rstrip()]
    independent, consequences = split_consequences(root, result.failures)
    for failure, ranks in group_failures(independent):
        same = failure.signature == root.signature
        label = "the same error" if same else failure.headline
        plural = "s" if len(ranks) > 1 else ""
        lines.append(f"\nRank{plural} {', '.join(map(str, ranks))} also failed: {label}")
        if not same and failure.traceback:
            lines.append(failure.traceback.rstrip())
    if consequences:
        lines.append("\nConsequences (ranks that failed or waited because of it):")
        lines += [f"  rank {f.rank}: {short_message(f)} ({after(root)})" for f in consequences]
    if result.stacks:
        lines.append(f"\nStacks of the stuck ranks ({', '.join(map(str, sorted(result.stacks)))}"
                     "): result.stacks, or `%elastic stacks`")
    lines.append(f"\nLogs: {result.log_dir}")
    return "\n".join(lines)


class JobFailedError(RuntimeError):
    """The job ended in failure after its restarts; ``.result`` holds the details. Its
    message names the root cause first, then the other ranks' failures.

    Args:
        result: The failed job's JobResult (its ``.result``).
        shown: The output shows the root cause's traceback already (IPython notes just that).
    """

    def __init__(self, result: JobResult, *, shown: bool = False) -> None:
        super().__init__(describe_failure(result))
        self.result = result
        self.shown = shown  # the cell's output already shows the root cause's traceback

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the kernel-side stack, which says nothing useful.
        if self.shown:
            return [f"JobFailedError: {self.args[0].splitlines()[0]}",
                    "(its traceback is in the output above; the error's .result has it all)"]
        return [f"JobFailedError: {self.args[0]}"]
