"""Where per-rank logs live: ``<log_dir>/<run_id>/attempt_<n>/rank_<r>/{stdout,stderr}.log``.
One place for the layout; ``attempt`` counts worker groups (restarts and resizes)."""

from __future__ import annotations

from pathlib import Path


def rank_dir(job_logs: Path, attempt: int, rank: int) -> Path:
    return job_logs / f"attempt_{attempt}" / f"rank_{rank}"


def latest_attempt(job_logs: Path) -> int | None:
    numbers = [int(p.name.removeprefix("attempt_")) for p in job_logs.glob("attempt_*")]
    return max(numbers, default=None)


def rank_log(job_logs: Path, rank: int, stream: str = "stdout",
             attempt: int | None = None) -> Path | None:
    """One rank's log file, of the latest attempt by default; None if there is none."""
    attempt = latest_attempt(job_logs) if attempt is None else attempt
    if attempt is None:
        return None
    return rank_dir(job_logs, attempt, rank) / f"{stream}.log"
